"""comm.transports(): which transport a large message would use with each peer, and why."""

import contextlib
import multiprocessing as mp

import pytest
from conftest import NO_TWO_WAY_PTRACE, TWO_WAY_PTRACE

import cma

JOIN_TIMEOUT = 20


@contextlib.contextmanager
def child_with(comm_end, target, *args):
    """Run ``target(comm_end, *args)`` in a forked child; always end it and close ``comm_end``
    here. Yields the process; the caller asserts its exit code after joining."""
    p = mp.get_context("fork").Process(target=target, args=(comm_end, *args))
    try:
        p.start()
        comm_end.close()
        yield p
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def _attach_and_wait(comm):
    comm.attach()
    comm.recv(source=0, tag=1)  # stay attached until the parent has looked
    comm.close()


@pytest.mark.parametrize(
    ("transport", "options", "uses", "protocol"),
    [
        # the measured defaults: cma with both sides copying matched the pipeline from 4 MiB
        pytest.param("auto", {}, "cma", "SPLIT",
                     marks=pytest.mark.skipif(not TWO_WAY_PTRACE, reason=NO_TWO_WAY_PTRACE)),
        # without SPLIT the one-sided copies lost to the pipeline here, so auto stages
        ("auto", {"split": False}, "shm", "PIPELINE"),
        # a lowered threshold brings the one-sided cma copy back
        ("auto", {"split": False, "thresholds": {"cma": 0}}, "cma", "RGET"),
        pytest.param("auto", {"push": True}, "cma", "RPUT",
                     marks=pytest.mark.skipif(not TWO_WAY_PTRACE, reason=NO_TWO_WAY_PTRACE)),
        # a named transport is used whatever the thresholds; vmfd cannot push without push=True
        ("vmfd", {}, "vmfd", "RGET"),
        ("vmfd", {"push": True}, "vmfd", "RPUT"),
    ],
)
def test_report_names_the_transport_large_messages_use(transport, options, uses, protocol):
    a, b = cma.Pipe(transport=transport, **options)
    with contextlib.closing(a), child_with(b, _attach_and_wait):
        report = a.transports()
        assert set(report) == {1}
        assert (report[1]["uses"], report[1]["protocol"]) == (uses, protocol)
        assert uses in report[1]["usable"]
        assert report[1]["unavailable"] == {}
        # auto moves nothing by vmfd where cma reaches the peer, so it does not probe it
        assert report[1]["unprobed"] == (["vmfd"] if transport == "auto" else [])
        a.send("done", dest=1, tag=1)


DENIED = "not permitted (test: as if ptrace rules refused it)"


@pytest.fixture
def cma_denied(monkeypatch):
    """Every cma probe fails as EPERM would, in this process and in forked children."""
    from cma.transports.cma import CmaTransport

    monkeypatch.setattr(CmaTransport, "probe", lambda self, peer: DENIED)


def _large_echo(comm):
    import numpy as np

    buf = np.empty(4 << 20, np.uint8)
    comm.Recv(buf, source=0, tag=2)
    comm.Send(buf, dest=0, tag=3)
    comm.close()


def test_auto_falls_back_when_cma_is_refused(cma_denied):
    import numpy as np

    a, b = cma.Pipe(thresholds={"cma": 0, "vmfd": 0})  # prefer the single-copy transports
    with contextlib.closing(a), child_with(b, _large_echo):
        report = a.transports()[1]
        assert report["uses"] == "vmfd"
        assert "cma" not in report["usable"]
        assert DENIED in report["unavailable"]["cma"]
        assert report["unprobed"] == []  # (vmfd moves data here: probed)
        data = np.arange(4 << 20, dtype=np.uint8)
        back = np.empty_like(data)
        a.Send(data, dest=1, tag=2)
        a.Recv(back, source=1, tag=3)
        assert np.array_equal(data, back)
        stats = a.stats()
        assert stats["vmfd"]["messages"] == 1  # the reply, pulled here by vmfd
        assert stats["cma"]["messages"] == 0


def _expect_unavailable(comm, queue):
    try:
        comm.attach()
        queue.put("attached")
    except cma.errors.TransportUnavailable as exc:
        queue.put(str(exc))
    finally:
        comm.close()


def test_requested_transport_refused_fails_at_connect_on_both_ranks(cma_denied):
    a, b = cma.Pipe(transport="cma")
    queue = mp.get_context("fork").Queue()
    with contextlib.closing(a), child_with(b, _expect_unavailable, queue):
        with pytest.raises(cma.errors.TransportUnavailable, match="cannot be used") as caught:
            a.attach()
        assert DENIED in str(caught.value)
        child = queue.get(timeout=JOIN_TIMEOUT)
        assert "cannot be used" in child and child != "attached"
