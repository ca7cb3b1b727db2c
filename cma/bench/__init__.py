"""``cma-bench``: OSU-style latency and bandwidth of every cma transport beside baselines.

::

    cma-bench                                  # = cma-bench latency --quick: every
                                               #   transport and baseline, 8 B .. 64 MiB
    cma-bench latency --transport shm,cma --min-size 4K --max-size 16M --json out.json
    cma-bench bw --transport all --plot bw.png
    cma-bench bibw --cold                      # fresh receive buffers: page faults included
    cma-bench latency --format mpi4py          # rows like ``python -m mpi4py.bench pingpong``
    mpiexec -n 2 cma-bench latency             # adds plain mpi4py and cma.mpi.Comm(COMM_WORLD)
    cma-bench latency --rounds 5               # every series 5 times in turn; medians of rounds
    cma-bench latency --rounds 5 --interleave  # ... taking those turns at every size
    cma-bench latency --guard 120              # time each size only while the CPUs are quiet
    cma-bench latency --buffer numpy,spec      # one series per buffer form: shm[numpy], shm[spec]...
    mpiexec -n 2 cma-bench bw --waitall mpi    # cma.mpi waits with MPI.Request.Waitall

Without mpiexec every peer is a child process this command starts (spawn) for each
series and ends before the next one (with ``--interleave``, one per series for the
whole run). Under mpiexec, rank 0 prints and runs the local series (with its own child
processes) while the other ranks wait without spinning; the MPI series (``mpi4py``,
``cma.mpi``) run between ranks 0 and 1.

Every number is measured in this run: times with ``time.perf_counter_ns`` per iteration
(latency) or per window (bw, bibw), copies from both processes' ``comm.stats()`` over the
timed loop only. With ``--rounds N`` the series take turns N times and each size reports
the median of its N round means; ``--interleave`` takes those turns at every size.
"""

from .cli import main

__all__ = ["main"]
