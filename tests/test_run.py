"""The ``cma-run`` launcher: ``python -m cma.run -n N python prog.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import cma
from cma import _linux, channel
from cma.world import PHASE_PUBLISHED, World

RUN_TIMEOUT = 120

RING = """
import os, sys
import numpy as np
import cma

comm = cma.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
out = sys.argv[1]
right, left = (rank + 1) % size, (rank - 1) % size
sizes = [n for n in [0, 100, 8192, 8193, 100_000, (3 << 20) + 5]
         if n <= int(os.environ.get("RING_MAX_SIZE", n))]
for rnd in range(3):
    for it, n in enumerate(sizes):
        tag = rnd * 100 + it
        data = np.full(n, (rank * 7 + tag) % 251, np.uint8)
        buf = np.empty(n, np.uint8)
        st = cma.Status()
        comm.Sendrecv(data, right, tag, buf, left, tag, st)
        assert (st.source, st.tag, st.count) == (left, tag, n), st
        assert (buf == (left * 7 + tag) % 251).all()
        req = comm.Isend(data, left, tag + 50)
        comm.Recv(buf, right, tag + 50)
        req.Wait()
        assert (buf == (right * 7 + tag) % 251).all()
    comm.Barrier()
obj = comm.sendrecv({"rank": rank, "arr": np.arange(rank, rank + 5000)}, dest=right, source=left)
assert obj["rank"] == left and (obj["arr"] == np.arange(left, left + 5000)).all()
comm.Barrier()
with open(os.path.join(out, f"rank{rank}"), "w") as f:
    f.write(f"{rank} {size} {comm.transport} {os.getpid()}")
"""

FAIL = """
import os, sys
import numpy as np
import cma

comm = cma.COMM_WORLD
out = sys.argv[1]
with open(os.path.join(out, f"pid{comm.rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(out, f"pid{comm.rank}.tmp"), os.path.join(out, f"pid{comm.rank}"))
comm.Barrier()  # every pid is on disk before anyone fails
if comm.rank == 2:
    sys.exit(3)
comm.Recv(np.empty(10), source=cma.ANY_SOURCE, tag=1)  # nobody sends: blocks until stopped
"""

GATHER = """
import os, sys
import numpy as np
import cma

comm = cma.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if rank == 0:
    seen = []
    buf = np.empty(200_000, np.uint8)
    for _ in range(3 * (size - 1)):
        st = cma.Status()
        comm.Recv(buf, source=cma.ANY_SOURCE, tag=cma.ANY_TAG, status=st)
        assert st.tag % 10 == st.source and st.count == 1000 * st.tag, st
        assert (buf[: st.count] == st.source).all()
        seen.append((st.source, st.tag))
    for src in range(1, size):  # non-overtaking per sender, whatever the interleaving
        assert [t for s, t in seen if s == src] == [src, 10 + src, 100 + src], seen
    comm.Barrier()
    ranks = sorted(comm.recv(source=cma.ANY_SOURCE, tag=7) for _ in range(size - 1))
    assert ranks == list(range(1, size))
    with open(os.path.join(sys.argv[1], "gather"), "w") as f:
        f.write("ok")
else:
    for tag in (rank, 10 + rank, 100 + rank):
        comm.Send(np.full(1000 * tag, rank, np.uint8), dest=0, tag=tag)
    comm.Barrier()
    comm.send(rank, dest=0, tag=7)
comm.Barrier()
"""

HANG = """
import os, sys, time
import cma

comm = cma.COMM_WORLD
with open(os.path.join(sys.argv[1], f"pid{comm.rank}"), "w") as f:
    f.write(str(os.getpid()))
comm.Barrier()
time.sleep(600)
"""


def cma_run(args: list[str], prog: str, tmp_path: Path, env: dict[str, str] | None = None,
            timeout: float = RUN_TIMEOUT) -> tuple[int, str, str, float]:
    """Run cma-run in its own process group; on timeout the whole group is killed."""
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(prog))
    cmd = [sys.executable, "-m", "cma.run", *args, sys.executable, str(path), str(tmp_path)]
    run_env = {k: v for k, v in os.environ.items() if k != "CMA_TRANSPORT"}
    run_env.update(env or {})
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=run_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"cma-run {' '.join(args)} did not finish in {timeout} s\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the group left behind
        except ProcessLookupError:
            pass
    return proc.returncode, out, err, time.monotonic() - t0


def read_ranks(tmp_path: Path, n: int) -> list[list[str]]:
    return [(tmp_path / f"rank{r}").read_text().split() for r in range(n)]


def assert_all_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ranks_ring_and_barrier(tmp_path, n):
    """Four ranks on two cores must progress too (oversubscribed: they yield and sleep)."""
    code, out, err, _ = cma_run(["-n", str(n)], RING, tmp_path)
    assert code == 0, err
    ranks = read_ranks(tmp_path, n)
    assert [int(r[0]) for r in ranks] == list(range(n))
    assert all(int(r[1]) == n for r in ranks)
    assert all(r[2] == "auto" for r in ranks)
    assert len({r[3] for r in ranks}) == n  # one process per rank
    assert_all_gone([int(r[3]) for r in ranks])


PINNED = """
import os, sys
import cma

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # as taskset -c, a cpuset would
comm = cma.COMM_WORLD
comm.attach()
assert comm._progress.oversubscribed, "two ranks on one CPU taken for ranks with a core each"
comm.Barrier()
if comm.Get_rank() == 0:
    open(os.path.join(sys.argv[1], "pinned"), "w").write("ok")
"""


def test_ranks_confined_to_fewer_cpus_than_the_machine_has_yield(tmp_path):
    """Oversubscription counts the CPUs a rank may run on, not the machine's: two ranks
    that taskset (or a Slurm job's or a container's cpuset) confine to one CPU must yield
    while they wait. Counted with os.cpu_count(), they spun for 1 ms at a time while their
    peer could not run: 1.6 ms per Sendrecv of 8 B (docs/architecture.md, "Waiting when
    ranks outnumber CPUs")."""
    code, out, err, _ = cma_run(["-n", "2"], PINNED, tmp_path)
    assert code == 0, err
    assert (tmp_path / "pinned").read_text() == "ok"


SPREAD = """
import os, sys
import cma

comm = cma.COMM_WORLD
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[comm.Get_rank()]})  # a core each
comm.attach()
assert not comm._progress.oversubscribed, "ranks pinned to a core each taken for ranks sharing one"
comm.Barrier()
if comm.Get_rank() == 0:
    open(os.path.join(sys.argv[1], "spread"), "w").write("ok")
"""


@pytest.mark.skipif(_linux.usable_cpus() < 2, reason="needs two usable CPUs to pin two ranks apart")
def test_ranks_pinned_to_a_core_each_do_not_count_as_oversubscribed(tmp_path):
    """Oversubscription counts the CPUs of the world's ranks, not of the rank alone: ranks
    pinned to a core each (cma-bench --bind, taskset per rank, a launcher's binding) have
    one CPU each in their masks. Counted alone they yielded instead of spinning and pulled
    instead of splitting (docs/architecture.md, "Waiting when ranks outnumber CPUs", has
    the times)."""
    code, out, err, _ = cma_run(["-n", "2"], SPREAD, tmp_path)
    assert code == 0, err
    assert (tmp_path / "spread").read_text() == "ok"


LATE_SPREAD = """
import os, sys, time
import cma
from cma import _linux

comm = cma.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
# a machine of a CPU per rank, each rank pinned to its own (this one may have fewer: the
# masks the ranks publish and the count of them are what is tested)
os.sched_getaffinity = lambda pid: {rank}
os.cpu_count = lambda: size
_linux.cgroup_cpu_quota = lambda *args: None
flag = os.path.join(sys.argv[1], "attached")
if rank == 0:
    comm.attach()  # before the others: its own mask is all it counts
    alone = comm._progress.oversubscribed
    open(flag, "w").close()
else:
    while not os.path.exists(flag):
        time.sleep(0.01)
    comm.attach()
for peer in range(size):
    if peer != rank:
        comm.send(rank, dest=peer)
assert sorted(comm.recv(source=peer) for peer in range(size) if peer != rank) == \
    [peer for peer in range(size) if peer != rank]
progress = comm._progress
state = (progress.oversubscribed, progress.connection.policy.crowded, comm._fast_spins > 0,
         progress.direct.spins > 0)
assert state == (False, False, True, True), state
comm.Barrier()
if rank == 0:
    open(os.path.join(sys.argv[1], "late"), "w").write(f"alone crowded {alone}")
"""


def test_a_rank_that_attached_first_counts_the_cpus_of_the_peers_that_connect_later(tmp_path):
    """In a world of three, a rank that attaches before the others have published their
    masks counts its own CPU alone and takes itself for crowded; as each peer connects it
    adds that peer's, and with a CPU per rank its fast paths spin again."""
    code, out, err, _ = cma_run(["-n", "3"], LATE_SPREAD, tmp_path)
    assert code == 0, err
    assert (tmp_path / "late").read_text() == "alone crowded True"


def test_published_cpus_are_the_union_of_the_masks_each_counted_once():
    """A mask wider than the published bitmap folds onto it, and the rank's own CPUs are
    counted from what it published, never twice (CPU 600 and its fold 88 both counted)."""
    bits = channel.CPU_WORDS * 64
    world = World.__new__(World)  # (its header alone: nothing attached)
    world.size = 2
    words = channel.PREAMBLE_WORDS + 2 * channel.RANK_BLOCK_WORDS
    world.header = memoryview(bytearray(8 * words)).cast("q")  # (as World maps it)
    for rank, cpus in ((0, {1, bits + 88}), (1, {88, 3, 2 * bits - 1})):
        world.rank = rank
        world.publish_cpus(cpus)
        world.header[world._word(rank, channel.PHASE)] = PHASE_PUBLISHED
    assert world.published_cpus() == {1, 3, 88, bits - 1}
    world.header[world._word(1, channel.PHASE)] = 0  # not attached yet
    assert world.published_cpus() == {1, 88}
    assert world.cpus_of(1) == {3, 88, bits - 1}


def test_any_source_from_many_ranks(tmp_path):
    code, out, err, _ = cma_run(["-n", "4"], GATHER, tmp_path)
    assert code == 0, err
    assert (tmp_path / "gather").read_text() == "ok"


@pytest.mark.parametrize("transport", cma.transport_names())
def test_transport_flag(tmp_path, transport):
    args, env = ["-n", "2", "--transport", transport], {}
    if transport == "ptrace":
        # (a word per system call: 3 MiB messages took 20 s of CI; a small eager limit
        # still sends 8193 and 100,000 bytes through it)
        args += ["--eager-limit", "4096"]
        env["RING_MAX_SIZE"] = "100000"
    code, out, err, _ = cma_run(args, RING, tmp_path, env=env)
    assert code == 0, err
    assert [r[2] for r in read_ranks(tmp_path, 2)] == [transport, transport]


@pytest.mark.parametrize("transport", ["shm", "vmfd"])
def test_transport_env(tmp_path, transport):
    code, out, err, _ = cma_run(["-n", "2"], RING, tmp_path, env={"CMA_TRANSPORT": transport})
    assert code == 0, err
    assert [r[2] for r in read_ranks(tmp_path, 2)] == [transport, transport]


def test_transport_flag_beats_env(tmp_path):
    code, out, err, _ = cma_run(["-n", "2", "--transport", "shm"], RING, tmp_path,
                                env={"CMA_TRANSPORT": "vmfd"})
    assert code == 0, err
    assert [r[2] for r in read_ranks(tmp_path, 2)] == ["shm", "shm"]


@pytest.mark.parametrize(("eager_limit", "transport"), [("0", "shm"), ("0", "cma"), ("100", "shm")])
def test_small_eager_limit_and_staging(tmp_path, eager_limit, transport):
    """Tiny slots: every control packet but FIN spans several ring slots."""
    args = ["-n", "2", "--transport", transport, "--eager-limit", eager_limit,
            "--frag-size", "4096", "--stage-slots", "1", "--timeout", "20"]
    code, out, err, _ = cma_run(args, RING, tmp_path, timeout=60)
    assert code == 0, f"exit {code} (124: the ranks hung)\n{err}"
    assert [r[2] for r in read_ranks(tmp_path, 2)] == [transport, transport]


START_METHOD = """
import multiprocessing as mp, os, sys
import numpy as np
import cma

def child(end):
    end.Send(np.full(1000, end.rank + 1, np.uint8), dest=0, tag=2)
    end.close()

if __name__ == "__main__":
    mp.set_start_method(sys.argv[2])
    comm = cma.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    got = comm.sendrecv(rank, dest=(rank + 1) % size, source=(rank - 1) % size)
    assert got == (rank - 1) % size
    a, b = cma.Pipe()
    proc = mp.Process(target=child, args=(b,))
    proc.start()
    b.close()
    buf = np.zeros(1000, np.uint8)
    a.Recv(buf, source=1, tag=2)
    proc.join(30)
    assert proc.exitcode == 0 and (buf == 2).all()
    a.close()
    comm.Barrier()
    with open(os.path.join(sys.argv[1], f"rank{rank}"), "w") as f:
        f.write(mp.get_start_method())
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_ranks_under_each_start_method(tmp_path, method):
    """A rank of cma-run that sets a start method (3.14 makes forkserver the default on
    Linux) talks over COMM_WORLD and to a child of its own through cma.Pipe."""
    path = tmp_path / "prog.py"
    path.write_text(START_METHOD)
    cmd = [sys.executable, "-m", "cma.run", "-n", "2", "--timeout", "60", sys.executable,
           str(path), str(tmp_path), method]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [method, method]


def test_failing_rank_stops_everyone(tmp_path):
    code, out, err, elapsed = cma_run(["-n", "4"], FAIL, tmp_path, timeout=60)
    assert code == 3, err
    assert "rank 2" in err
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(4)]
    assert_all_gone(pids)
    assert elapsed < 30, f"cma-run took {elapsed:.1f} s to give up"


KILLED = FAIL.replace("sys.exit(3)", "import signal; os.kill(os.getpid(), signal.SIGKILL)")


def test_a_killed_rank_of_three_is_named_with_its_signal(tmp_path):
    code, out, err, elapsed = cma_run(["-n", "3"], KILLED, tmp_path, timeout=60)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]
    assert code == 128 + signal.SIGKILL, err
    assert f"rank 2 (pid {pids[2]}) was killed by SIGKILL" in err, err
    assert_all_gone(pids)
    print(f"cma-run gave up after {elapsed:.2f} s (the ranks' start included)")


def test_timeout_stops_everyone(tmp_path):
    code, out, err, elapsed = cma_run(["-n", "2", "--timeout", "3"], HANG, tmp_path, timeout=60)
    assert code == 124, err
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert_all_gone(pids)
    assert elapsed < 30


@pytest.mark.parametrize("n", ["0", "-3"])
def test_no_ranks_is_an_error(tmp_path, n):
    proc = subprocess.run([sys.executable, "-m", "cma.run", "-n", n, sys.executable, "-c", "pass"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=tmp_path)
    assert proc.returncode == 2
    assert f"-n must be at least 1 (got {n})" in proc.stderr, proc.stderr


def test_a_program_that_does_not_exist_is_an_error(tmp_path):
    missing = str(tmp_path / "no-such-program")
    proc = subprocess.run([sys.executable, "-m", "cma.run", "-n", "2", missing], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, cwd=tmp_path)
    assert proc.returncode == 127
    assert f"cannot start {missing!r}: No such file or directory (give the program's path" \
        in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_program_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cma.run", "-n", "2"], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, cwd=tmp_path)
    assert proc.returncode != 0
    assert "no program" in proc.stderr


def test_unknown_transport_fails_every_rank(tmp_path):
    code, out, err, _ = cma_run(["-n", "2", "--transport", "no-such"], RING, tmp_path,
                                timeout=60)
    assert code != 0
    assert "unknown transport" in err
