"""Round trips (Send then Recv of the echo) per transport and size, with measured copies."""

from __future__ import annotations

from typing import Any

import pytest

from cma.bench.sizes import KIB, MIB, format_size

# rounds per size: enough for a stable mean, few enough that 16 MiB stays short
ROUNDS = {8: 2000, 64 * KIB: 500, MIB: 100, 16 * MIB: 20}


@pytest.mark.parametrize("size", list(ROUNDS), ids=format_size)
def test_round_trip(benchmark: Any, echo_peer: Any, size: int) -> None:
    rounds = ROUNDS[size]
    warmup = max(1, rounds // 10)
    # pytest-benchmark may add a call for --benchmark-cprofile: announce one more
    echo_peer.begin(size, rounds + warmup + 1)
    benchmark.group = f"round trip {format_size(size)}"
    benchmark.pedantic(echo_peer.round_trip, rounds=rounds, warmup_rounds=warmup,
                       iterations=1)
    copies = echo_peer.end()
    assert echo_peer.recv[0] == echo_peer.recv[-1] == 0x5A  # the echo came back intact
    info: dict[str, Any] = {"transport": echo_peer.transport, "size": size}
    if copies is not None:
        info.update(via="+".join(copies.via), user_copies=copies.user,
                    kernel_copies=copies.kernel, syscalls_per_message=copies.syscalls)
    if benchmark.stats is not None:  # None under --benchmark-disable
        one_way = benchmark.stats.stats.mean / 2
        info["bandwidth_MBps"] = size / one_way / 1e6
    benchmark.extra_info.update(info)
