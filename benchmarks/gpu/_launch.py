"""The lone-client section's `launch` part (`_lone.py`): one item's forward pass back to
back on each kind of thread (the loop's, a pool thread, one with its own stream, a
`WorkerThread` plain and bound to the device): the thread's own cost apart from the
proxy's.
"""

from __future__ import annotations

import asyncio
import inspect
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sample_text import make_sentences  # (light: no torch)

from benchmarks._harness.clients import percentile_ms

LAUNCH_CALLS = 200  # per variant and repeat
QUICK_LAUNCH_CALLS = 20


async def launch_by_thread(model: Any, tokenizer: Any, device: str, calls: int) -> dict[str, Any]:
    """One lone item's forward pass, back to back, on each kind of thread: the time to
    launch it (until `forward` returns) and to its result on the CPU, both measured on
    that thread. Tells the thread's own cost (an event loop, a CUDA stream of its own)
    from the proxy's."""
    import concurrent.futures

    import torch
    from bert_app import probabilities
    from minilm import tokenize

    from batchproxy import WorkerThread

    cuda = device.startswith("cuda")
    item = tokenize(tokenizer, make_sentences(1, seed=21)[0])
    ids, mask = item["input_ids"].unsqueeze(0), item["attention_mask"].unsqueeze(0)
    seconds: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def forward(name: str, non_blocking: bool = False) -> Callable[[Any], Any]:
        def run(_: Any) -> list[None]:
            started = time.perf_counter()
            probs = probabilities(
                model,
                ids.to(device, non_blocking=non_blocking),
                mask.to(device, non_blocking=non_blocking),
            )
            launched = time.perf_counter()
            if non_blocking and cuda:
                out = probs.to("cpu", non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
                event.synchronize()
            else:
                out = probs.cpu()
            del out
            seconds[name].append((launched - started, time.perf_counter() - started))
            return [None]

        return run

    def own_stream() -> None:
        if cuda:
            torch.cuda.set_stream(torch.cuda.Stream())  # type: ignore[no-untyped-call]

    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool_stream = concurrent.futures.ThreadPoolExecutor(1, initializer=own_stream)
    plain = WorkerThread("launch-plain")
    bound = WorkerThread("launch-bound", device=device if cuda else None)
    loop = asyncio.get_running_loop()
    variants: dict[str, Callable[[], Any]] = {
        "main_thread": lambda: forward("main_thread")([None]),
        "pool_thread": lambda: loop.run_in_executor(pool, forward("pool_thread"), None),
        "pool_thread_own_stream": lambda: loop.run_in_executor(
            pool_stream, forward("pool_thread_own_stream"), None
        ),
        "worker_thread": lambda: plain.run(forward("worker_thread"), [None]),
        "worker_thread_device": lambda: bound.run(forward("worker_thread_device"), [None]),
        "worker_thread_device_async_copies": lambda: bound.run(
            forward("worker_thread_device_async_copies", non_blocking=True), [None]
        ),
    }
    try:
        for call in variants.values():  # warm-up
            for _ in range(5):
                result = call()
                if inspect.isawaitable(result):
                    await result
        seconds.clear()
        for repeat in range(2):
            names = list(variants) if repeat == 0 else list(variants)[::-1]
            for name in names:
                for _ in range(calls):
                    result = variants[name]()
                    if inspect.isawaitable(result):
                        await result
    finally:
        pool.shutdown()
        pool_stream.shutdown()
        await plain.aclose()
        await bound.aclose()
    return {
        name: {
            "launch_ms": 1000 * statistics.fmean(t[0] for t in times),
            "total_ms": 1000 * statistics.fmean(t[1] for t in times),
            "launch_p50_ms": percentile_ms([t[0] for t in times], "p50"),
        }
        for name, times in seconds.items()
    }
