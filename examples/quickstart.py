"""batchproxy in one screen: 200 concurrent callers, a handful of model calls.

Run it with `python examples/quickstart.py` (or `make demo`).

A toy "model" that costs a fixed 5 ms per call plus 0.1 ms per item, like an
accelerator where one big batch is far cheaper than many small ones. 200
coroutines each ask for one result at the same moment; the proxy groups them
into batches of at most 32 and every caller gets exactly its own answer.
"""

from __future__ import annotations

import asyncio

from typing_extensions import override

from batchproxy import Proxy, ProxyStats

CALLERS = 200
BATCH_SIZE = 32


class ToyModel(Proxy[str, int]):
    """Reads the number at the end of each prompt and squares it, a batch at a time."""

    def __init__(self) -> None:
        super().__init__(batch_size=BATCH_SIZE, max_delay_ms=2.0)
        self.model_calls = 0

    @override
    async def _inference(self, arguments: list[str]) -> list[int]:
        self.model_calls += 1
        await asyncio.sleep(0.005 + 0.0001 * len(arguments))  # the "forward pass"
        return [int(prompt.rsplit("-", 1)[1]) ** 2 for prompt in arguments]


def report(stats: ProxyStats) -> str:
    """The demo's printout: counts, the batch-size histogram, latency percentiles."""
    lines = [
        f"requests:    {stats.requests}",
        f"model calls: {stats.batches} batches",
        "batch sizes:",
    ]
    widest = max(stats.batch_sizes.values(), default=1)
    for size, count in stats.batch_sizes.items():
        bar = "#" * max(1, round(40 * count / widest))
        lines.append(f"  {size:>4} items | {bar} {count}")
    latency = stats.total_latency
    lines += [
        f"mean batch size: {stats.mean_batch_size:.1f}",
        f"latency p50: {latency.p50 * 1e3:.1f} ms   p99: {latency.p99 * 1e3:.1f} ms",
    ]
    return "\n".join(lines)


async def main() -> ProxyStats:
    """Run the demo; return the proxy's final stats."""
    prompts = [f"prompt-{i}" for i in range(CALLERS)]
    async with ToyModel() as model:
        results = await asyncio.gather(*(model.inference(prompt) for prompt in prompts))
        stats = model.stats
    # every caller got its own (unique) result, and the model ran once per batch
    if results != [i**2 for i in range(CALLERS)]:
        raise SystemExit("a caller got somebody else's result")
    if model.model_calls != stats.batches:
        raise SystemExit(f"{model.model_calls} model calls but {stats.batches} batches")
    print(report(stats))
    return stats


if __name__ == "__main__":
    asyncio.run(main())
