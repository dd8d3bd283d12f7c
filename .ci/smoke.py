"""The installed wheel on its own: what `pip install batchproxy` gives a user works.

Run by `.ci/package` with the interpreter of a fresh virtualenv that holds the wheel
and its core dependencies only, from a directory where the source tree is not
importable. Every step asserts its outcome: a proxy answers 1,000 concurrent calls,
each with its own result, in batches; `@batch` on a function and on a method;
`inference_sync` from plain threads; `aclose`, after which calls are refused.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import re
import threading
from pathlib import Path

import batchproxy
from batchproxy import Proxy, ProxyClosed, batch

CALLS = 1_000
THREADS = 8
CORE = {"batchproxy", "numpy", "typing-extensions"}
"""What the wheel installs: itself and its core dependencies (and the venv's own pip)."""


def the_installed_wheel() -> str:
    """batchproxy comes from this virtualenv's site-packages, with nothing but its core
    dependencies beside it; its version is the one its metadata gives."""
    package = Path(batchproxy.__file__).resolve().parent
    assert "site-packages" in package.parts, f"batchproxy imported from {package}"
    assert package != Path(__file__).resolve().parent.parent / "batchproxy"
    assert (package / "py.typed").is_file(), "py.typed is missing"
    assert batchproxy.__version__ == importlib.metadata.version("batchproxy")
    installed = {
        re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        for dist in importlib.metadata.distributions()
    }
    assert installed - {"pip", "setuptools", "wheel"} == CORE, installed
    for extra in ("torch", "ray", "fastapi", "pytest", "hypothesis"):
        assert importlib.util.find_spec(extra) is None, f"{extra} is installed"
    return f"batchproxy {batchproxy.__version__} from {package}"


class Squares(Proxy[int, int]):
    """An async model on the event loop: 1 ms per batch, whatever its size."""

    def __init__(self) -> None:
        super().__init__(batch_size=64, max_delay_ms=2.0)
        self.sizes: list[int] = []

    async def _inference(self, items: list[int]) -> list[int]:
        self.sizes.append(len(items))
        await asyncio.sleep(0.001)
        return [i * i for i in items]


async def concurrent_calls() -> str:
    proxy = Squares()
    results = await asyncio.gather(*(proxy.inference(i) for i in range(CALLS)))
    assert results == [i * i for i in range(CALLS)], "a caller got another's result"
    stats = proxy.stats
    assert (stats.requests, stats.succeeded, stats.items) == (CALLS, CALLS, CALLS), stats
    assert sum(proxy.sizes) == CALLS, proxy.sizes
    assert max(proxy.sizes) <= 64, proxy.sizes
    assert len(proxy.sizes) <= CALLS // 8, f"hardly batched: {len(proxy.sizes)} model calls"
    await proxy.aclose()
    assert proxy.closed
    try:
        await proxy.inference(1)
    except ProxyClosed:
        pass
    else:
        raise AssertionError("a closed proxy took a call")
    return f"{CALLS:,} concurrent calls in {len(proxy.sizes)} batches (largest {max(proxy.sizes)})"


@batch(batch_size=32)
def double(items: list[int]) -> list[int]:
    """A plain function: it runs on the proxy's worker thread."""
    return [2 * i for i in items]


class Model:
    def __init__(self, offset: int) -> None:
        self.offset = offset

    @batch(batch_size=16)
    async def shift(self, items: list[int]) -> list[int]:
        return [i + self.offset for i in items]


async def decorated() -> str:
    results = await asyncio.gather(*(double(i) for i in range(200)))
    assert results == [2 * i for i in range(200)]
    assert double.stats.batches < 200
    assert max(double.stats.batch_sizes) > 1
    first, second = Model(1), Model(1000)  # one proxy per instance
    assert await asyncio.gather(first.shift(1), second.shift(1)) == [2, 1001]
    assert await first.shift.many([1, 2, 3]) == [2, 3, 4]
    await double.aclose()
    await first.shift.aclose()
    await second.shift.aclose()
    return f"@batch: 200 calls in {double.stats.batches} batches, one proxy per instance"


class Slow(Proxy[int, str]):
    """An async model that takes 5 ms a batch: callers pile up meanwhile."""

    def __init__(self) -> None:
        super().__init__(batch_size=THREADS)
        self.sizes: list[int] = []

    async def _inference(self, items: list[int]) -> list[str]:
        self.sizes.append(len(items))
        await asyncio.sleep(0.005)
        return [f"r{i}" for i in items]


def from_threads() -> str:
    """Plain threads block in `inference_sync`; the proxy, bound to no loop, is served
    by the default background loop."""
    proxy = Slow()
    per_thread = CALLS // THREADS
    results: dict[int, list[str]] = {}
    start = threading.Barrier(THREADS)

    def work(n: int) -> None:
        start.wait()
        first = n * per_thread
        results[n] = [proxy.inference_sync(i, timeout=30) for i in range(first, first + per_thread)]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a thread is still blocked in inference_sync"
    assert sorted(results) == list(range(THREADS))
    for n, got in results.items():
        assert got == [f"r{i}" for i in range(n * per_thread, (n + 1) * per_thread)]
    assert sum(proxy.sizes) == CALLS, proxy.sizes
    assert max(proxy.sizes) > 1, proxy.sizes
    asyncio.run(proxy.aclose())  # from another loop: the proxy's own loop drains it
    assert proxy.closed
    try:
        proxy.inference_sync(1, timeout=5)
    except ProxyClosed:
        pass
    else:
        raise AssertionError("a closed proxy took a call from a thread")
    return (
        f"inference_sync from {THREADS} threads: {CALLS:,} calls in {len(proxy.sizes)} batches "
        f"(largest {max(proxy.sizes)}); aclose from another loop"
    )


def main() -> None:
    lines = [the_installed_wheel(), asyncio.run(concurrent_calls())]
    lines += [asyncio.run(decorated()), from_threads()]
    for line in lines:
        print(f"smoke: {line}")
    print("smoke: passed")


if __name__ == "__main__":
    main()
