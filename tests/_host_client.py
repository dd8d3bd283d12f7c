"""A client process for the model-host tests: `python tests/_host_client.py SOCKET ID N`
sends N calls at once, `(ID, i)` for i in range(N), and prints one JSON line: how many
came back right, wrong, or failed (by error class), and the batch ids it saw with
their sizes. With `--forever` it keeps sending until killed (the killed-client test);
with `--on-go`, once connected it prints `ready` and sends when a line comes on stdin
(the test starts several clients' calls together)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter

from batchproxy.host import RemoteProxy


async def main(path: str, ident: str, count: int, forever: bool, on_go: bool) -> None:
    remote = RemoteProxy(path)  # (not `async with`, which would wait for a host: none may be)
    try:
        if on_go:
            await remote.start()  # connected, the host answering
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
        while True:
            items = [(ident, i) for i in range(count)]
            answers = await remote.inference_many(items, return_exceptions=True)
            if forever:
                continue
            right = wrong = 0
            failed: Counter[str] = Counter()
            batches = {}
            for item, answer in zip(items, answers, strict=True):
                if isinstance(answer, BaseException):
                    failed[type(answer).__name__] += 1
                elif tuple(answer[0]) == item:
                    right += 1
                    batches[answer[1]] = answer[2]
                else:
                    wrong += 1
            summary = {"right": right, "wrong": wrong, "failed": failed, "batches": batches}
            print(json.dumps(summary), flush=True)
            return
    finally:
        await remote.aclose()


if __name__ == "__main__":
    flags = sys.argv[4:]
    asyncio.run(
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--forever" in flags, "--on-go" in flags)
    )
