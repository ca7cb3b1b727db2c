"""``cma-run -n N prog [args]``: start N ranks of a program sharing one cma world.

Like ``mpiexec``: every rank gets ``cma.COMM_WORLD`` (rank and size from the
launcher); when a rank fails, the others are stopped and ``cma-run`` exits with the
failing rank's code. The world's memfd and doorbells are inherited by the ranks
(``pass_fds``), so nothing is created in /dev/shm.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from . import _linux
from .channel import ChannelConfig
from .errors import CmaError
from .world import ENV_TRANSPORT, ENV_WORLD, FDS_PER_RANK, FDS_SPARE, WorldFds, announce

# How long a rank told to stop (SIGTERM) may take before it is killed: time to run its
# handlers and close its communicator (docs/api.md, cma-run); chosen, not measured.
GRACE_SECONDS = 3.0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="cma-run",
        description="Start N processes of a program that share a cma COMM_WORLD.",
    )
    parser.add_argument("-n", "-np", dest="n", type=int, required=True, help="number of ranks")
    parser.add_argument("--transport", default=os.environ.get(ENV_TRANSPORT, "auto"),
                        help=f"transport of COMM_WORLD (default auto; also ${ENV_TRANSPORT})")
    parser.add_argument("--eager-limit", type=int,
                        help="largest message sent inline in the control ring (bytes; default "
                        "2 MiB for 2 ranks, less from 3 on: ChannelConfig.for_ranks)")
    parser.add_argument("--frag-size", type=int, help="shm pipeline fragment size (bytes)")
    parser.add_argument("--stage-slots", type=int, help="shm pipeline staging slots per pair")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop every rank and fail after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="program and its arguments")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no program given (e.g. cma-run -n 4 python prog.py)")
    if args.n < 1:
        parser.error(f"-n must be at least 1 (got {args.n}): the number of ranks to start")
    return args


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + GRACE_SECONDS
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _how(code: int) -> str:
    """How a rank ended, as Popen's return code tells it (negative: the signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def launch(args: argparse.Namespace) -> int:
    given = {name: getattr(args, name) for name in ("eager_limit", "frag_size", "stage_slots")}
    config = dataclasses.replace(ChannelConfig.for_ranks(args.n),
                                 **{name: value for name, value in given.items() if value is not None})
    try:
        config.validate()
    except ValueError as exc:
        print(f"cma-run: {exc}", file=sys.stderr)
        return 2
    try:
        _linux.ensure_fd_limit(FDS_PER_RANK * args.n + FDS_SPARE)  # the ranks inherit the limit
    except CmaError as exc:
        print(f"cma-run: {exc}", file=sys.stderr)
        return 2
    fds = WorldFds.create(args.n, config)
    procs: list[subprocess.Popen[bytes]] = []
    interrupted: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(args.n):
            env = dict(os.environ, **{ENV_WORLD: fds.to_env(rank), ENV_TRANSPORT: args.transport})
            procs.append(subprocess.Popen(args.command, env=env, pass_fds=fds.inheritable_by(rank)))
            announce(fds, rank, procs[-1].pid)  # its peers then see it exit before connecting
        fds.close()  # the ranks hold their own copies now
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                if not interrupted:
                    print(f"cma-run: rank {rank} (pid {procs[rank].pid}) {_how(code)}; "
                          "stopping the others", file=sys.stderr)
                _stop(procs)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"cma-run: timed out after {args.timeout} s; stopping every rank",
                      file=sys.stderr)
                _stop(procs)
                return 124
            time.sleep(0.01)
    except OSError as exc:
        print(f"cma-run: cannot start {args.command[0]!r}: {exc.strerror or exc} (give the "
              "program's path, or a name on PATH, e.g. cma-run -n 2 python prog.py)",
              file=sys.stderr)
        _stop(procs)
        return 127
    finally:
        fds.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    return launch(_parse(argv))


if __name__ == "__main__":
    sys.exit(main())
