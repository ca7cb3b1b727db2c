"""Message sizes for ``cma-bench``: parsing, formatting and ranges of sizes, and how many
iterations (timed and warm-up) each size gets."""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("latency", "bw", "bibw")
KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


# ---------------------------------------------------------------- sizes

_UNITS = {"": 1, "b": 1, "k": KIB, "kib": KIB, "m": MIB, "mib": MIB, "g": GIB, "gib": GIB}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``8``, ``8B``, ``4K``, ``64KiB``, ``1M``, ``64MiB``, ``1G`` (units are binary)."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        # "KB"/"MB" are refused rather than guessed: decimal or binary is exactly what a
        # reader of the results would need to know.
        raise ValueError(
            f"bad size {text!r}: use a number with an optional binary unit "
            "K, KiB, M, MiB, G or GiB (4K = 4096)"
        )
    return int(match.group(1)) * _UNITS[unit]


def format_size(nbytes: int) -> str:
    """``8 B``, ``4 KiB``, ``64 MiB``; sizes that are not whole units keep bytes."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_range(min_size: int, max_size: int) -> list[int]:
    """The powers of two in ``[min_size, max_size]``."""
    if min_size < 1:
        raise ValueError("--min-size must be at least 1 byte")
    if max_size < min_size:
        raise ValueError(f"--max-size {max_size} is below --min-size {min_size}")
    size = 1 << (min_size - 1).bit_length()
    sizes = []
    while size <= max_size:
        sizes.append(size)
        size <<= 1
    if not sizes:
        raise ValueError(f"no power of two between {min_size} and {max_size}")
    return sizes


# ---------------------------------------------------------------- iteration counts


@dataclass(frozen=True)
class CountPolicy:
    """OSU-style iteration counts: many for small messages, few for large ones.

    ``byte_budget`` caps how many bytes one size may move (warm-up excluded), so large
    messages take about as long as small ones instead of dominating the run.
    """

    small_iterations: int
    small_warmup: int
    large_iterations: int
    large_warmup: int
    byte_budget: int
    min_iterations: int


# OSU switches to its "large" counts above 8 KiB.
LARGE_MESSAGE = 8 * KIB
POLICIES: dict[tuple[str, bool], CountPolicy] = {
    ("latency", False): CountPolicy(10_000, 1_000, 1_000, 100, 4 * GIB, 5),
    ("latency", True): CountPolicy(2_000, 200, 200, 20, 256 * MIB, 3),
    ("window", False): CountPolicy(100, 10, 20, 2, 16 * GIB, 3),
    ("window", True): CountPolicy(20, 2, 5, 1, 1 * GIB, 2),
}


def messages_per_sample(kind: str, window: int) -> int:
    """Payload messages in one timed sample: a round trip, a window, or a window each way."""
    if kind == "latency":
        return 2
    if kind == "bw":
        return window
    if kind == "bibw":
        return 2 * window
    if kind == "memcpy":
        return 1
    raise ValueError(f"unknown benchmark kind {kind!r}")


def counts_for(
    kind: str,
    size: int,
    *,
    window: int,
    quick: bool,
    iterations: int | None = None,
    warmup: int | None = None,
) -> tuple[int, int]:
    """(timed iterations, warm-up iterations) for one message size."""
    policy = POLICIES[("window" if kind in ("bw", "bibw") else "latency", quick)]
    if size <= LARGE_MESSAGE:
        iters, warm = policy.small_iterations, policy.small_warmup
    else:
        iters, warm = policy.large_iterations, policy.large_warmup
    per_iteration = size * messages_per_sample(kind, window)
    iters = min(iters, max(policy.min_iterations, policy.byte_budget // per_iteration))
    warm = min(warm, max(1, iters // 10))
    return (iterations if iterations is not None else iters,
            warmup if warmup is not None else warm)
