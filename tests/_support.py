"""Test doubles shared by the test modules (import as `from _support import Recorder`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import override

import batchproxy


class Recorder(batchproxy.Proxy[Any, Any]):
    """An async test model: records every batch, answers with `respond(items)`.

    Default answer: `("out", item)` per item, so a caller can check it got its own.
    `delay` (seconds) is awaited inside the model call, so it runs on the (virtual)
    clock under looptime.
    """

    def __init__(
        self,
        respond: Callable[[list[Any]], Sequence[Any]] | None = None,
        *,
        delay: float = 0.0,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.batches: list[list[Any]] = []
        self.started_at: list[float] = []
        self.respond = respond or (lambda items: [("out", item) for item in items])
        self.delay = delay

    @override
    async def _inference(self, items: list[Any]) -> Sequence[Any]:
        self.batches.append(list(items))
        self.started_at.append(asyncio.get_running_loop().time())
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.respond(items)
