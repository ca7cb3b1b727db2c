#!/usr/bin/env bash
# regenerate.sh - rebuild the measured figures and tables that docs/guide.md,
# docs/registration.md and docs/transports.md quote.
#
# Usage (from the repository root, with cma-ipc installed, e.g. `pip install -e .`):
#
#     bash docs/figures/regenerate.sh
#
# What it runs (about 25 minutes on a 2-vCPU machine, most of it pauses):
#   1. latency  - blocking ping-pong, 8 B .. 64 MiB, every transport.
#                 Writes latency.txt (table + crossovers), latency.json.gz (every
#                 sample and the machine description) and latency.png.
#                 If `mpiexec` is on PATH (the published run used MPICH's Hydra
#                 `mpiexec -n 2` with mpi4py 4.1), the run is launched under
#                 `mpiexec -n 2`, which adds the plain `mpi4py` baseline and the
#                 `cma.mpi` series. Without mpiexec, cma-bench spawns its own
#                 two processes and those two series are absent.
#   1b. latency-large - the same from 64 MiB to 256 MiB, into latency-large.txt,
#                 with a 60 s pause between series (--settle), chosen when slow
#                 spells seemed to follow large frees; they do not (guide.md,
#                 section 6), and --guard is the better defence.
#   1c. latency-mpi - cma.mpi.Comm against plain mpi4py alone (only under
#                 mpiexec), 8 B .. 64 MiB, into latency-mpi.txt: in the big run
#                 cma.mpi comes last, where the slow spells hit it most.
#   1d. latency-rounds - under mpiexec only: every series 1 B .. 64 MiB, three
#                 rounds, --guard 60, into latency-rounds.txt (each size's round
#                 means, the waits and every timed loop the guard left out). The
#                 run that issues 3 and 4 quote for their speed targets.
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

launch=()
if command -v mpiexec >/dev/null 2>&1; then
    launch=(mpiexec -n 2)
    echo "regenerate.sh: latency run under: ${launch[*]}" >&2
else
    echo "regenerate.sh: no mpiexec; latency run without the mpi4py baseline" >&2
fi

"${launch[@]}" python -m cma.bench latency --transport all --min-size 8 --max-size 64M --settle 60 \
    --json docs/figures/latency.json --plot docs/figures/latency.png \
    > docs/figures/latency.txt

"${launch[@]}" python -m cma.bench latency --transport all --min-size 64M --max-size 256M \
    --settle 60 > docs/figures/latency-large.txt

if [ ${#launch[@]} -gt 0 ]; then
    sleep 60
    "${launch[@]}" python -m cma.bench latency --transport cma.mpi --baseline mpi4py \
        --min-size 8 --max-size 64M > docs/figures/latency-mpi.txt
    "${launch[@]}" python -m cma.bench latency --transport all --baseline memcpy,mpi4py \
        --min-size 1 --max-size 64M --rounds 3 --guard 60 > docs/figures/latency-rounds.txt
fi

python -m cma.bench bw --transport all --min-size 4K --max-size 4M --quick \
    --json docs/figures/bw.json --plot docs/figures/bw.png \
    > docs/figures/bw.txt

python -m cma.bench latency --transport all --min-size 64K --max-size 16M --quick --cold \
    > docs/figures/latency-cold.txt

# every sample of the latency run is ~12 MB of JSON: keep it compressed in the repository
gzip -f docs/figures/latency.json

echo "regenerate.sh: done; see docs/figures/*.txt and *.png" >&2
