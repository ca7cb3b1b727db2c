#!/usr/bin/env bash
# regenerate.sh - rebuild the measured figures and tables that docs/guide.md,
# docs/registration.md and docs/transports.md quote.
#
# Usage (from the repository root, with cma-ipc installed, e.g. `pip install -e .`):
#
#     bash docs/figures/regenerate.sh
#
# What it runs (30-55 minutes on a 2-vCPU machine, depending on the guard's waits). Every step passes
# --guard 60 when the machine has two CPUs: each size is timed only while a probe finds
# the CPUs passing data at their usual speed (guide.md, section 6).
#   1. latency  - blocking ping-pong, 8 B .. 64 MiB, every transport, one round.
#                 Writes latency.txt (table, copy counts, crossovers), latency.json.gz
#                 (every sample and the machine description) and latency.png.
#                 If `mpiexec` is on PATH (the published run used MPICH's Hydra
#                 `mpiexec -n 2` with mpi4py 4.1), the latency steps run under
#                 `mpiexec -n 2`, which adds the plain `mpi4py` baseline and the
#                 `cma.mpi` series. Without mpiexec, cma-bench spawns its own
#                 two processes, those two series are absent and 1c-1i are skipped.
#   1b. latency-large - the same from 64 MiB to 256 MiB, into latency-large.txt.
#   1c. latency-mpi - cma.mpi.Comm against plain mpi4py alone, 1 B .. 64 MiB, nine
#                 rounds interleaved (at each size both series take all their turns
#                 before the next size), into latency-mpi.txt: issue 4's comparison.
#                 A slow stretch of the machine then lands on both series alike.
#   1d. latency-rounds - every series 1 B .. 64 MiB with the memcpy and mpi4py
#                 baselines, five rounds, into latency-rounds.txt (each size's
#                 round means, the waits and every timed loop the guard left out):
#                 issue 3's comparison.
#   1e. latency-interleaved - as 1d with --interleave (at each size every series takes
#                 its five turns before the next size), into latency-interleaved.txt:
#                 how far series on the same code path still differ when measured
#                 side by side.
#   1f. latency-mpi-small - as 1c from 1 B to 64 KiB, seven rounds, into
#                 latency-mpi-small.txt: the eager sizes, where a wrapper's call shows.
#   1g. bw-mpi  - cma.mpi.Comm against plain mpi4py in the osu_bw pattern (a window of
#                 64 Isends, Waitall, a 1-byte ack), 8 B .. 4 MiB, five rounds
#                 interleaved, into bw-mpi.txt.
#   1h. external-clients - clients nobody here wrote, with only the one-line change:
#                 mpi4py's own `mpi4py.bench pingpong` (NumPy and bytearray buffers,
#                 and NumPy arrays as objects, pickled (-p) and through pkl5 (-o),
#                 1 B .. 64 MiB) and the demo/osu_latency, osu_bw and osu_bibw programs of
#                 the installed mpi4py's sdist (downloaded once with pip into
#                 ~/.cache/cma-ipc, or $CMA_IPC_CACHE), each plain and through
#                 cma.mpi.Comm, six rounds alternating which goes first, into
#                 external-clients.txt (bench/external_clients.py; no --guard: it reports
#                 the hand-off probe and CPU share of every round instead). ~5 minutes.
#   1i. datatypes - ping-pong of derived-datatype messages (a column, the faces of a
#                 3-D block, records, MINLOC pairs, 28.8 MB of rows), plain mpi4py and
#                 cma.mpi.Comm in alternating order, six rounds, into datatypes.txt
#                 (bench/datatypes.py). ~1 minute.
#   1j. scale   - cma-run -n N against mpiexec -n N (plain mpi4py) for N = 2 .. 64, in
#                 alternating order: ready time, shared memory mapped and resident per
#                 rank, fds, 8 B / 1 MiB all-to-all and a ring exchange, into scale.txt,
#                 scale.json and scale.png (bench/scale.py). ~10 minutes.
#   1k. collectives - cma.mpi's Bcast, Reduce, Allreduce, Allgather and Alltoall against
#                 mpi4py + MPICH's, 8 B .. 16 MiB, --quick, into collectives-2.txt. ~1 minute.
#   1l. copy-floor - bench/copy_floor.py: the same ping-pong with as little Python as
#                 possible around the copies (one process_vm_readv; the ring's double copy,
#                 whole and in pieces), 16 KiB .. 2 MiB, into copy-floor.txt: what cma's
#                 paths could reach at best on this machine (mpi.md quotes it).
#   1m. direct  - bench/direct_ab.py: the direct rendezvous against the eager ring in one
#                 pair, blocks alternating, 64 KiB .. 2 MiB, into direct-ab.txt
#                 (architecture.md, "Direct rendezvous": where DIRECT_FROM comes from).
#   1n. untouched-buffers - bench/untouched_buffers.py (needs mpiexec): the ping-pong of
#                 mpi4py.bench with a never-written numpy.empty send buffer (pingpong -a
#                 numpy's, all the kernel's zero page), a written one and a bytearray,
#                 plain and through cma.mpi, 256 KiB .. 2 MiB, into untouched-buffers.txt
#                 (mpi.md: why -a numpy runs faster than -a none for both libraries).
#   1o. request-window - bench/request_window.py (needs mpiexec): osu_bibw's window of
#                 Irecvs and Isends at 8 B, plain and through cma.mpi, its time per message
#                 split into posting, sending and delivering, into request-window.txt
#                 (mpi.md, "Windows of requests"). ~1 minute.
#   1p. quiet-ring - bench/quiet_ring.py: what a pair pays to talk again after its rings'
#                 pages went back to the kernel, against a quiet pause that kept them, into
#                 quiet-ring.txt (architecture.md, "Memory per rank"). ~1 minute.
#   2. bw       - window of 64 Isends + ack, 4 KiB .. 4 MiB, --quick.
#                 Writes bw.txt, bw.json, bw.png.
#   3. latency --cold - a never-touched receive buffer each iteration,
#                 64 KiB .. 16 MiB, --quick, so first-touch page faults show up.
#                 Writes latency-cold.txt.
#
# cma-bench pins the two processes to separate CPUs by default (--bind).
# Results on a shared VM vary by 15-40 % between runs; compare ratios within
# one run, not absolute numbers across runs or machines.
# Plots need matplotlib.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

guard=()
if [ "$(python -c 'import os; print(len(os.sched_getaffinity(0)))')" -ge 2 ]; then
    guard=(--guard 60)
fi

launch=()
if command -v mpiexec >/dev/null 2>&1; then
    launch=(mpiexec -n 2)
    echo "regenerate.sh: latency run under: ${launch[*]}" >&2
else
    echo "regenerate.sh: no mpiexec; latency run without the mpi4py baseline" >&2
fi

"${launch[@]}" python -m cma.bench latency --transport all --min-size 8 --max-size 64M \
    "${guard[@]}" --json docs/figures/latency.json --plot docs/figures/latency.png \
    > docs/figures/latency.txt

"${launch[@]}" python -m cma.bench latency --transport all --min-size 64M --max-size 256M \
    "${guard[@]}" > docs/figures/latency-large.txt

if [ ${#launch[@]} -gt 0 ]; then
    "${launch[@]}" python -m cma.bench latency --transport cma.mpi --baseline mpi4py \
        --min-size 1 --max-size 64M --rounds 9 --interleave "${guard[@]}" \
        > docs/figures/latency-mpi.txt
    "${launch[@]}" python -m cma.bench latency --transport all --baseline memcpy,mpi4py \
        --min-size 1 --max-size 64M --rounds 5 "${guard[@]}" > docs/figures/latency-rounds.txt
    "${launch[@]}" python -m cma.bench latency --transport all --baseline memcpy,mpi4py \
        --min-size 1 --max-size 64M --rounds 5 --interleave "${guard[@]}" \
        > docs/figures/latency-interleaved.txt
    "${launch[@]}" python -m cma.bench latency --transport cma.mpi --baseline mpi4py \
        --min-size 1 --max-size 64K --rounds 7 --interleave "${guard[@]}" \
        > docs/figures/latency-mpi-small.txt
    "${launch[@]}" python -m cma.bench bw --transport cma.mpi --baseline mpi4py \
        --min-size 8 --max-size 4M --rounds 5 --interleave "${guard[@]}" \
        > docs/figures/bw-mpi.txt
    "${launch[@]}" python bench/external_clients.py > docs/figures/external-clients.txt
    "${launch[@]}" python bench/datatypes.py > docs/figures/datatypes.txt
    "${launch[@]}" python bench/untouched_buffers.py --rounds 6 > docs/figures/untouched-buffers.txt
    "${launch[@]}" python bench/request_window.py --size 8 --rounds 4 > docs/figures/request-window.txt
    python bench/scale.py --ranks 2 4 8 16 32 64 --json docs/figures/scale.json \
        --plot docs/figures/scale.png > docs/figures/scale.txt
    for collective in bcast reduce allreduce allgather alltoall; do
        "${launch[@]}" python -m cma.bench "$collective" --quick --max-size 16M
        echo
    done > docs/figures/collectives-2.txt
fi

python bench/copy_floor.py --pieces 64K,256K --rounds 3 > docs/figures/copy-floor.txt
python bench/direct_ab.py > docs/figures/direct-ab.txt
python bench/quiet_ring.py --bursts 31 --quiet 2.2 > docs/figures/quiet-ring.txt

python -m cma.bench bw --transport all --min-size 4K --max-size 4M --quick "${guard[@]}" \
    --json docs/figures/bw.json --plot docs/figures/bw.png \
    > docs/figures/bw.txt

python -m cma.bench latency --transport all --min-size 64K --max-size 16M --quick --cold \
    "${guard[@]}" > docs/figures/latency-cold.txt

# xmap (docs/figures/xmap.txt and xmap-2026-12-04.txt were made by hand, with mpiexec -n 2 for the
# warm table; 2026-12-04's recv_view run with --iterations 200 --warmup 20 --rounds 3):
# python -m cma.bench latency --transport xmap,auto --baseline memcpy,memcpy2,mpi4py \
#     --min-size 64K --max-size 64M --quick --rounds 3
# python -m cma.bench latency --transport xmap --baseline none --cold --min-size 4M --max-size 64M --quick --rounds 3
# python -m cma.bench latency --transport xmap --baseline none --recv-view --min-size 64K --max-size 1G --quick
# python bench/xmap_reduce.py --size 64M --repeat 7
# the same against Ray, multiprocessing.shared_memory and torch.multiprocessing, in a venv of
# its own (pip install -e . ray torch): figures/peers-2026-12-04.txt
# python bench/peers.py --json docs/figures/peers-2026-12-04.json

# every sample of the latency run is ~12 MB of JSON: keep it compressed in the repository
gzip -f docs/figures/latency.json

echo "regenerate.sh: done; see docs/figures/*.txt and *.png" >&2
