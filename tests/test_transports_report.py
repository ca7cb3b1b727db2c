"""comm.transports(): which transport a large message would use with each peer, and why."""

import multiprocessing as mp

import pytest

import cma

JOIN_TIMEOUT = 20


def _attach_and_wait(comm):
    comm.attach()
    comm.recv(source=0, tag=1)  # stay attached until the parent has looked
    comm.close()


@pytest.mark.parametrize(
    ("transport", "thresholds", "expected"),
    [
        ("auto", None, "shm"),  # the measured defaults: the pipeline beat cma and vmfd here
        ("auto", {"cma": 0}, "cma"),  # lowered threshold: cma takes large messages again
        ("vmfd", None, "vmfd"),  # a named transport is used whatever the thresholds
    ],
)
def test_report_names_the_transport_large_messages_use(transport, thresholds, expected):
    a, b = cma.Pipe(transport=transport, thresholds=thresholds)
    p = mp.get_context("fork").Process(target=_attach_and_wait, args=(b,))
    try:
        p.start()
        b.close()
        report = a.transports()
        assert set(report) == {1}
        assert report[1]["uses"] == expected
        assert expected in report[1]["usable"]
        assert report[1]["unavailable"] == {}
        a.send("done", dest=1, tag=1)
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        a.close()
