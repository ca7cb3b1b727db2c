"""A world's memory and fds grow with its ranks, not with their square (issue #24).

The bound is ``ChannelConfig.for_ranks`` / ``channel_budget`` (docs/architecture.md, "Memory
per rank"): checked on the sizes themselves for N up to 1024, and in cma-run worlds by
reading each rank's own mappings of the world's segment from /proc/self/smaps.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import COUNTS_RING_PAGES, TWO_WAY_PTRACE, run_ranks
from test_run import cma_run

import cma
import cma.channel
import cma.errors
import cma.progress
from cma import _linux
from cma.channel import ChannelConfig, channel_budget

RUN_TIMEOUT = 120
# fds a rank holds per connected peer: its doorbell and pidfd, and under auto vmfd's fd
# onto the peer's memory only where cma does not reach the peer (ranks are siblings)
FDS_PER_PEER = 2 if TWO_WAY_PTRACE else 3

# what a rank program reads of its own mappings: cma's memfd, mapped and resident
MAPPINGS = """
def cma_mappings():
    mapped = resident = 0
    mine = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                mine = "memfd:cma-" in line
            elif mine and first == "Size:":
                mapped += int(line.split()[1]) << 10
            elif mine and first == "Rss:":
                resident += int(line.split()[1]) << 10
    return mapped, resident
"""

RANK = """
import json, os, sys
import numpy as np
import cma
""" + MAPPINGS + """
comm = cma.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
send, recv = np.full((size, 4096), rank, np.uint8), np.empty((size, 4096), np.uint8)
for step in range(1, size):
    dst, src = (rank + step) % size, (rank - step) % size
    comm.Sendrecv(send[dst], dst, 1, recvbuf=recv[src], source=src, recvtag=1)
    assert (recv[src] == src).all()
mapped, resident = cma_mappings()
figures = {"mapped": mapped, "resident": resident, "fds": len(os.listdir("/proc/self/fd"))}
comm.Barrier()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
    json.dump(figures, out)
"""


def expected_mapping(size: int) -> int:
    config = ChannelConfig.for_ranks(size)
    return config.header_bytes(size) + 2 * (size - 1) * config.pair_bytes


@pytest.mark.parametrize("size", [2, 3, 4, 8, 16, 17, 32, 64, 128, 256, 1000, 1024])
def test_default_sizes_keep_the_channels_within_the_budget(size):
    config = ChannelConfig.for_ranks(size)
    config.validate()
    channels = 2 * (size - 1) * config.pair_bytes
    if size > 2:
        assert channels <= channel_budget(size)
    else:
        assert config == ChannelConfig()  # two ranks keep the eager speed of the large ring
    assert config.eager_limit >= 64 << 10


def run_world(tmp_path: Path, program: str, size: int) -> list[dict]:
    """``program`` in a cma-run world of ``size`` ranks; what each rank wrote, by rank."""
    prog = tmp_path / "rank.py"
    prog.write_text(textwrap.dedent(program))
    done = subprocess.run([sys.executable, "-m", "cma.run", "-n", str(size), "--timeout",
                           str(RUN_TIMEOUT), sys.executable, str(prog), str(tmp_path)],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT + 30)
    assert done.returncode == 0, done.stderr
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]


@pytest.mark.parametrize("size", [3, 9])
def test_each_rank_maps_its_own_channels_only(tmp_path, size):
    ranks = run_world(tmp_path, RANK, size)
    for figures in ranks:
        # the header plus 2(N-1) channels; mapping the whole segment was N(N-1) channels
        assert figures["mapped"] == expected_mapping(size)
        assert figures["resident"] <= figures["mapped"]
        # every rank talked to every other: per peer a doorbell and a pidfd (and where cma
        # does not reach, vmfd's /proc/PID/mem fd), plus the memfd, the fd server and stdio
        assert figures["fds"] <= FDS_PER_PEER * size + 16


PAIRS = """
import json, os, sys
import numpy as np
import cma
from cma.channel import ChannelConfig
""" + MAPPINGS + """
comm = cma.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
partner = rank ^ 1 if rank ^ 1 < size else rank  # the last rank of an odd world talks to itself
data = np.full(1 << 16, rank, np.uint8)  # within the eager limit
big = np.full(1 << 20, rank, np.uint8)   # a rendezvous: the transports' probes and fds
got, got_big = np.empty_like(data), np.empty_like(big)
comm.Sendrecv(data, partner, 1, recvbuf=got, source=partner, recvtag=1)
comm.Sendrecv(big, partner, 2, recvbuf=got_big, source=partner, recvtag=2)
assert (got == partner).all() and (got_big == partner).all()
mapped, _ = cma_mappings()
figures = {"mapped": mapped, "fds": len(os.listdir("/proc/self/fd")),
           "connected": sorted(comm._progress.outboxes)}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
    json.dump(figures, out)
comm.Sendrecv(data, partner, 3, recvbuf=got, source=partner, recvtag=3)  # both wrote, then exit
"""


def test_a_rank_that_talks_to_one_peer_maps_one_peer_and_holds_its_fds_only(tmp_path):
    """Peers are connected on first use (issue #24): in a 9-rank world of pairs, each rank
    maps the header and its partner's two channels, and holds fds for that peer alone."""
    size = 9
    ranks = run_world(tmp_path, PAIRS, size)
    config = ChannelConfig.for_ranks(size)
    # the last rank talks to nobody: stdio, the memfd, its own doorbell and epoll set, the
    # fd server, the vmfd transport's own memory fd
    alone = ranks[-1]["fds"]
    assert alone <= 10, ranks[-1]
    for rank, figures in enumerate(ranks):
        peers = 0 if rank == size - 1 else 1
        assert figures["connected"] == ([rank ^ 1] if peers else [])
        assert figures["mapped"] == config.header_bytes(size) + 2 * peers * config.pair_bytes
        # and per connected peer its doorbell and pidfd (and vmfd's fd onto its memory where
        # cma does not reach it): no term in N (all N at attach held 3N plus a constant;
        # 3 per peer while auto also probed vmfd)
        assert figures["fds"] - alone <= FDS_PER_PEER * peers, (figures, alone)


def held_bytes(memfd: int) -> int:
    """Bytes of memory the world's memfd holds."""
    return os.fstat(memfd).st_blocks * 512


def idle(comm: cma.Comm) -> bool:
    """A rank that talks to no one (a third rank: the world is no longer two ranks')."""
    return True


def _quiet_ring_pair(wait: str, reader: str, count: int = 64, block: int = 64 << 10,
                     ranks: int = 3):
    """Rank 0 sends ``count`` eager messages of ``block`` bytes, then waits for rank 1 in
    ``wait`` ("Recv": the fast path's await_head; "Irecv-Wait": the engine's doze) while
    rank 1 reads them, at once or ("late") after a pause in which rank 0 goes quiet
    first, and then for a second more. Rank 0 returns the bytes the world's memfd held
    right after its sends and after that second, and the warnings it gave.

    The world has the two ranks' 8 MiB rings; with ``ranks`` 3 (a third rank that does
    nothing) its windows are not resident, as in every world of more than two ranks."""

    def rank0(comm):
        with warnings.catch_warnings(record=True) as given:
            warnings.simplefilter("always")
            return (*sent_and_quiet(comm), [str(w.message) for w in given])

    def sent_and_quiet(comm):
        comm.attach()
        memfd = comm._progress.world.fds.memfd
        for i in range(count):
            comm.Send(np.full(block, i, np.uint8), dest=1, tag=1)
        sent = held_bytes(memfd)
        receive = np.zeros(1, np.uint8)
        for tag in (2, 3):  # (2: rank 1 has read them all)
            if wait == "Recv":
                comm.Recv(receive, source=1, tag=tag)
            else:
                comm.Irecv(receive, source=1, tag=tag).Wait()
        quiet = held_bytes(memfd)
        for i in range(8):
            comm.Send(np.full(block, 100 + i, np.uint8), dest=1, tag=4)
        return sent, quiet

    def rank1(comm):
        got = np.empty(block, np.uint8)
        comm.attach()
        if reader == "late":
            time.sleep(0.5)  # (rank 0 goes quiet, while its ring is still full of packets)
        for i in range(count):
            comm.Recv(got, source=0, tag=1)
            assert (got == i).all()
        comm.Send(np.zeros(1, np.uint8), dest=0, tag=2)
        time.sleep(1.0)  # (how long rank 0 waits: the scenario, not a wait for anything)
        comm.Send(np.zeros(1, np.uint8), dest=0, tag=3)
        for i in range(8):
            comm.Recv(got, source=0, tag=4)
            assert (got == 100 + i).all()
        return True

    funcs = [rank0, rank1, idle][:ranks]
    (sent, quiet, given), *_ = run_ranks("shm", ChannelConfig(), funcs, timeout=RUN_TIMEOUT)
    return sent, quiet, given


@pytest.mark.parametrize("reader", ["prompt", "late"])
@pytest.mark.parametrize("wait", ["Recv", "Irecv-Wait"])
def test_a_rank_hands_back_the_pages_of_a_ring_gone_quiet_while_it_sleeps(wait, reader, monkeypatch):
    """Once rank 0's ring to rank 1 is quiet (no packet written, none read) while rank 0
    sleeps, its pages go back to the kernel: the world's memfd holds less, and later
    messages through the ring arrive whole. A reader that was late, so that rank 0 went
    quiet with its ring full, frees the pages when it catches up (they stayed held).
    (Quiet here after 0.1 s, not 1 s: the forked ranks inherit the setting. A world of
    three ranks: a two-rank world keeps its windows, the next test.)"""
    monkeypatch.setattr(cma.progress, "QUIET_SECONDS", 0.1)
    sent, quiet, given = _quiet_ring_pair(wait, reader)
    # 4 MiB through the 8 MiB ring, whose writer keeps to a 4 MiB window while it can
    assert sent >= 3 << 20, f"the messages touched only {sent} bytes"
    assert sent - quiet >= 3 << 20, f"{sent} bytes after the messages, {quiet} after the quiet"
    assert given == []


@COUNTS_RING_PAGES
@pytest.mark.parametrize("reader", ["prompt", "late"])
def test_a_two_rank_world_keeps_its_windows_and_hands_back_only_what_spilled(reader, monkeypatch):
    """In a world of two ranks the window of a ring that carries traffic is faulted in
    and stays (docs/architecture.md, "Resident windows"): the quiet ring keeps it, and
    only the packets a late reader let spill past the window give their pages back."""
    monkeypatch.setattr(cma.progress, "QUIET_SECONDS", 0.1)
    window = ChannelConfig().window
    count = 96  # 6 MiB: a late reader lets the last 2 MiB spill past the 4 MiB window
    sent, quiet, given = _quiet_ring_pair("Recv", reader, count=count, ranks=2)
    assert quiet >= window, f"{quiet} bytes held after the quiet: the window went back"
    if reader == "late":
        assert sent - quiet >= (3 << 20) // 2, f"{sent} bytes after the messages, {quiet} after"
    assert given == []


@COUNTS_RING_PAGES
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_two_rank_ring_faults_its_window_in_once_it_carries_traffic(ranks):
    """A two-rank world's ring holds only what its packets touched until its writer
    passes RESIDENT_FROM (a pair that never talks, a Dup never used, costs no window),
    then its whole 4 MiB window at once: the first pass through fresh pages had cost the
    writer a fault per 4 KiB (961 faults over 120 messages of 32 KiB, ~27 us a message
    against ~3: docs/architecture.md, "Resident windows"). A world of three ranks with the
    same rings faults pages in as packets touch them, as before."""
    block = 24 << 10

    def rank0(comm):
        comm.attach()
        memfd = comm._progress.world.fds.memfd
        held = []
        for i in range(3):  # (the third passes RESIDENT_FROM)
            comm.Send(np.full(block, i, np.uint8), dest=1, tag=1)
            held.append(held_bytes(memfd))
        comm.Recv(np.zeros(1, np.uint8), source=1, tag=2)
        return held

    def rank1(comm):
        got = np.empty(block, np.uint8)
        for i in range(3):
            comm.Recv(got, source=0, tag=1)
            assert (got == i).all()
        comm.Send(np.zeros(1, np.uint8), dest=0, tag=2)
        return True

    packet = cma.channel.packet_bytes(block)
    assert 2 * packet <= cma.channel.RESIDENT_FROM < 3 * packet
    window = ChannelConfig().window
    held, *_ = run_ranks("shm", ChannelConfig(), [rank0, rank1, idle][:ranks],
                         timeout=RUN_TIMEOUT)
    assert held[1] < 1 << 20, f"{held}: the window was faulted in before traffic passed the stretch"
    if ranks == 2:
        assert held[2] >= window, f"{held}: the window was not faulted in"
    else:
        assert held[2] < 1 << 20, f"{held}: a three-rank world faulted a window in"


def test_a_rank_whose_kernel_refuses_to_take_pages_back_keeps_them_and_says_so(monkeypatch):
    """Handing pages back only saves memory: where madvise fails, the wait goes on and
    the rank warns once that it keeps its rings' pages."""
    monkeypatch.setattr(cma.progress, "QUIET_SECONDS", 0.1)

    def refused(*_):
        raise cma.errors.CmaError("cannot hand pages back: Function not implemented")

    monkeypatch.setattr(cma.channel, "release_pages", refused)  # (inherited by the forks)
    sent, quiet, given = _quiet_ring_pair("Recv", "prompt")
    assert quiet >= sent >= 3 << 20  # kept
    assert given == ["rank 0 keeps its rings' pages from now on: cannot hand pages back: "
                     "Function not implemented"]


def test_a_world_larger_than_the_soft_fd_limit_raises_it(tmp_path):
    """8 ranks need ~23-30 fds each: with a soft limit of 20 they would fail with EMFILE."""
    size, soft_limit = 8, 20
    prog = tmp_path / "rank.py"
    prog.write_text(textwrap.dedent(RANK))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def lower_the_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft_limit, hard))

    done = subprocess.run([sys.executable, "-m", "cma.run", "-n", str(size), "--timeout",
                           str(RUN_TIMEOUT), sys.executable, str(prog), str(tmp_path)],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT + 30,
                          preexec_fn=lower_the_soft_limit)
    assert done.returncode == 0, done.stderr
    fds = [json.loads((tmp_path / f"rank{r}.json").read_text())["fds"] for r in range(size)]
    assert max(fds) > soft_limit  # the test exercised what it claims to


def _echo(comm: cma.Comm) -> None:
    buf = np.empty(1 << 20, np.uint8)
    comm.Recv(buf, source=0, tag=1)
    comm.Send(buf, dest=0, tag=2)
    comm.close()


def test_a_process_holding_more_than_1024_fds_attaches_and_sees_its_peer_exit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard fd limit ({hard}) does not allow holding 1100 fds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) for _ in range(1100)]
    proc = None
    try:
        a, b = cma.Pipe(transport="auto")  # its eventfds and pidfds get numbers above 1024
        proc = mp.get_context("spawn").Process(target=_echo, args=(b,))
        proc.start()
        data = np.arange(1 << 20, dtype=np.uint8)
        back = np.empty_like(data)
        a.Send(data, dest=1, tag=1)
        a.Recv(back, source=1, tag=2)
        assert (back == data).all()
        proc.join(30)
        assert proc.exitcode == 0
        with pytest.raises(cma.errors.PeerGone):
            a.Recv(back, source=1, tag=3)  # the exit is seen through a pidfd above 1024
        a.close()
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


WILDCARD = """
import sys, time
import numpy as np
import cma

comm = cma.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if rank == 0:
    comm.attach()
    sources = []
    for _ in range(size - 1):
        status = cma.Status()
        buf = np.empty(1 << 20, np.uint8)
        comm.Recv(buf, source=cma.ANY_SOURCE, tag=4, status=status)  # waits before any connect
        assert (buf[: status.count] == status.source).all()
        sources.append(status.source)
    assert sorted(sources) == list(range(1, size)), sources
    print("OK", flush=True)
else:
    time.sleep(0.2)  # (rank 0 is asleep in its wildcard receive by then, most likely)
    n = 1 << 20 if rank == size - 1 else 8  # one rendezvous: the receiver learns our reach
    comm.Send(np.full(n, rank, np.uint8), dest=0, tag=4)
"""


def test_a_wildcard_receive_takes_messages_from_peers_not_connected_yet(tmp_path):
    code, out, err, _ = cma_run(["-n", "4", "--timeout", str(RUN_TIMEOUT)], WILDCARD, tmp_path)
    assert code == 0, err
    assert out.split() == ["OK"]


LEFT_BEHIND = """
import sys, time
import numpy as np
import cma

comm = cma.COMM_WORLD
rank = comm.Get_rank()
if rank == 2:
    comm.Send(np.full(8, 7, np.uint8), dest=0, tag=1)  # then exits: its ring keeps it
elif rank == 0:
    comm.attach()
    while not comm._world.exited(2):  # (rank 2 attached, sent and exited; not connected here)
        time.sleep(0.01)
    assert 2 not in comm._progress.outboxes
    buf = np.empty(8, np.uint8)
    comm.Recv(buf, source=2, tag=1)
    assert (buf == 7).all()
    try:
        comm.Recv(buf, source=2, tag=1)
    except cma.errors.PeerGone as exc:
        print("gone", exc, flush=True)
    try:
        comm.Recv(buf, source=1, tag=1)  # connected by the receive: its exit ends the wait
    except cma.errors.PeerGone as exc:
        print("gone", exc, flush=True)
else:
    comm.attach()
    time.sleep(0.3)
"""


def test_a_receive_from_an_unconnected_peer_takes_what_it_left_then_sees_it_exit(tmp_path):
    code, out, err, _ = cma_run(["-n", "3", "--timeout", str(RUN_TIMEOUT)], LEFT_BEHIND, tmp_path)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("gone rank 2") and lines[1].startswith("gone rank 1"), out


def test_the_scale_bench_runs_a_small_world(tmp_path):
    """bench/scale.py (the figures of docs/architecture.md, "Memory per rank") runs a
    3-rank world and reports every rank's figures."""
    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "bench" / "scale.py"),
                           "--ranks", "3", "--libs", "cma", "--alltoall-bytes", "4096",
                           "--json", str(tmp_path / "scale.json")],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr
    (run,) = json.loads((tmp_path / "scale.json").read_text())
    assert (run["lib"], run["ranks"], len(run["per_rank"])) == ("cma", 3, 3)
    assert all(rank["fds_after"] > 0 and rank["alltoall_8B_s"] > 0 for rank in run["per_rank"])


@pytest.mark.parametrize("form", [[], ["spec"], ["spec", "300000"]],
                         ids=["rows", "specs", "direct-size specs"])
def test_the_sendrecv_alltoall_bench_reports_a_small_world(form: list[str]):
    """bench/sendrecv_alltoall.py (docs/figures/oversubscribed-sendrecv-*.txt) under cma-run,
    with bare rows and with buffer specs, of 8 B and of a size above DIRECT_FROM."""
    program = Path(__file__).parents[1] / "bench" / "sendrecv_alltoall.py"
    done = subprocess.run([sys.executable, "-m", "cma.run", "-n", "3", sys.executable,
                           str(program), "cma", "3", *form],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    block = next((arg for arg in form if arg.isdigit()), "8")
    head = ["cma", *form[:1], "3", block, "B", "wall", "ms/iter"]
    assert words[:len(head)] == head and float(words[len(head)]) > 0, done.stdout


# ------------------------------------------------------------------ CPUs a world may use

def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(("files", "expected"), [
    # cgroup v2, the process's own cgroup and the root a container sees
    ({"self": "0::/job/42\n", "root/job/42/cpu.max": "150000 100000\n"}, 1.5),
    ({"self": "0::/job/42\n", "root/cpu.max": "300000 100000\n"}, 3.0),
    ({"self": "0::/\n", "root/cpu.max": "max 100000\n"}, None),
    ({"self": "0::/job/42\n", "root/unified/job/42/cpu.max": "200000 100000\n"}, 2.0),
    # cgroup v1: cfs quota over period, -1 for none
    ({"self": "4:memory:/x\n2:cpu,cpuacct:/slurm/7\n",
      "root/cpu/slurm/7/cpu.cfs_quota_us": "400000\n",
      "root/cpu/slurm/7/cpu.cfs_period_us": "100000\n"}, 4.0),
    ({"self": "2:cpu,cpuacct:/\n", "root/cpu/cpu.cfs_quota_us": "-1\n",
      "root/cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"self": "0::/gone\n"}, None),  # nothing readable: no quota known
])
def test_the_cgroup_cpu_quota_is_read_in_either_cgroup_version(tmp_path, files, expected):
    write_files(tmp_path, files)
    assert _linux.cgroup_cpu_quota(str(tmp_path / "root"), str(tmp_path / "self")) == expected


def test_usable_cpus_are_the_fewer_of_the_cpus_allowed_and_the_quota(tmp_path):
    write_files(tmp_path, {"self": "0::/\n", "root/cpu.max": "150000 100000\n"})
    quota = (str(tmp_path / "root"), str(tmp_path / "self"))
    assert _linux.usable_cpus(range(8), *quota) == 2  # 1.5 CPUs of time keep 2 busy
    assert _linux.usable_cpus([3], *quota) == 1
    assert _linux.usable_cpus({0, 1} | {1, 2}, str(tmp_path / "none"), str(tmp_path / "none")) == 3
    assert _linux.usable_cpus() <= len(os.sched_getaffinity(0))
