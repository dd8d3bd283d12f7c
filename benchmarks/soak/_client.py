"""A client process of the soak through a model host (`python -m benchmarks.soak._client
PATH COUNTERS RESULT REQUESTS CONCURRENCY SEED`): the soak's mix of calls through a
`RemoteProxy`, its tally in COUNTERS as it goes, its result in RESULT at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from dataclasses import asdict, replace

from batchproxy.host import RemoteProxy
from benchmarks.soak import _mix
from benchmarks.soak._counters import TALLY, Counters, SharedTally
from benchmarks.soak._host import write_json

# -- a client ------------------------------------------------------------------------------


def open_sockets() -> int:
    """This process's open sockets."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the directory's own descriptor, gone)
            count += os.readlink(os.path.join("/proc/self/fd", fd)).startswith("socket:")
    return count


async def client(
    path: str, counters_path: str, result_path: str, requests: int, concurrency: int, seed: int
) -> None:
    """One client process: `requests` calls of the mix through a `RemoteProxy`; its
    tally in `counters_path` as it goes, its result in `result_path` at the end."""
    config = replace(
        _mix.FULL, requests=requests, concurrency=concurrency, seed=seed, reconfigure_every_ms=None
    )
    counters = Counters(counters_path, TALLY)
    sockets = open_sockets()
    remote = RemoteProxy(path, connect_timeout=30.0)
    load = _mix.Load(config, remote, progress=False)  # type: ignore[arg-type]
    load.tally = SharedTally(counters)
    before = load.census()
    seconds = await load.run()
    await asyncio.sleep(0)
    after = load.census()
    await remote.aclose()
    await asyncio.sleep(0)
    closed = load.census()
    result = {
        "tally": asdict(load.tally),
        "seconds": seconds,
        "census": {"before": asdict(before), "after": asdict(after), "closed": asdict(closed)},
        "sockets": {"before": sockets, "closed": open_sockets()},
    }
    write_json(result_path, result)
    counters.close()


if __name__ == "__main__":
    path, counters, result, requests, concurrency, seed = sys.argv[1:7]
    asyncio.run(client(path, counters, result, int(requests), int(concurrency), int(seed)))
