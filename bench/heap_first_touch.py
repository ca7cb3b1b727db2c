"""First touch of a fresh shared segment: 4 KiB pages against 2 MiB transparent huge pages.

Why the heap rounds large segments to 2 MiB and advises MADV_HUGEPAGE: a fresh segment
costs a page fault (allocate, zero, map) per page on first touch, and a huge page
replaces 512 of them. Cases, each a fresh 256 MiB mapping written once per 4 KiB:

- ``memfd`` and ``memfd+madvise``: what the heap gets; memfd pages follow the kernel's
  shmem THP setting (/sys/kernel/mm/transparent_hugepage/shmem_enabled), so under
  "never" the advice changes nothing;
- ``anon`` and ``anon+madvise``: private anonymous memory, for scale;
- ``tmpfs`` and ``tmpfs+madvise`` with ``--tmpfs-file PATH``: a file on a tmpfs mounted
  with ``huge=always``, i.e. shmem pages as memfd would get them under shmem THP.

Not in CI. Run from the repository root; the tmpfs case needs root, in a private mount
namespace so that nothing changes for the rest of the machine::

    unshare -m sh -c 'mount -t tmpfs -o huge=always,size=1G none /mnt && \\
        PYTHONPATH=. python bench/heap_first_touch.py --tmpfs-file /mnt/f'
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import numpy as np

from cma import _linux

SIZE = 256 << 20


def huge_kib() -> int:
    """KiB of this process's memory in huge pages (anonymous and shmem)."""
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:")):
                total += int(line.split()[1])
    return total


def one(kind: str, advise: bool, path: str | None) -> tuple[float, int]:
    fd = -1
    if kind == "memfd":
        fd = _linux.memfd_segment("first-touch", SIZE)
    elif kind == "tmpfs":
        assert path is not None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.unlink(path)
        os.ftruncate(fd, SIZE)
    mm = _linux.map_shared(fd, SIZE) if fd >= 0 else mmap.mmap(-1, SIZE, mmap.MAP_PRIVATE)
    try:
        if advise:
            _linux.advise_huge_pages(mm)
        pages = np.frombuffer(mm, np.uint8)
        start = time.perf_counter()
        pages[::4096] = 1
        elapsed = time.perf_counter() - start
        del pages
        return elapsed, huge_kib()
    finally:
        mm.close()
        if fd >= 0:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tmpfs-file", help="a path on a tmpfs mounted with huge=always")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    kinds = ["memfd", "anon"] + (["tmpfs"] if args.tmpfs_file else [])
    cases = [(kind, advise) for kind in kinds for advise in (False, True)]
    times: dict[tuple[str, bool], list[float]] = {case: [] for case in cases}
    huge: dict[tuple[str, bool], int] = {}
    for _ in range(args.repeat):  # cases interleaved, so a slow spell hits them all
        for case in cases:
            elapsed, kib = one(*case, args.tmpfs_file)
            times[case].append(elapsed)
            huge[case] = kib
    print(f"load average {os.getloadavg()[0]:.2f}, shmem THP {_linux.shmem_huge_pages()!r}; first touch "
          f"of {SIZE >> 20} MiB, median [min-max] of {args.repeat}")
    for (kind, advise), t in times.items():
        med = statistics.median(t)
        print(f"{kind + ('+madvise' if advise else ''):>14}: {med * 1e3:8.1f} ms [{min(t) * 1e3:.1f}-"
              f"{max(t) * 1e3:.1f}]  {med / (SIZE / 4096) * 1e6:6.2f} us per 4 KiB  "
              f"huge pages seen: {huge[(kind, advise)] >> 10} MiB")


if __name__ == "__main__":
    main()
