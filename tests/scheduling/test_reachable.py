"""`BatchSizeUnreachable`: a bound in front of the batcher that keeps batches small."""

from __future__ import annotations

import asyncio
import warnings

import pytest
from _support import Recorder

import batchproxy
from batchproxy.integrations._serving import Serving


def test_a_queue_bound_below_batch_size_warns_at_construction() -> None:
    with pytest.warns(
        batchproxy.BatchSizeUnreachable, match=r"max_queue_size=4 is below batch_size=8"
    ):
        Recorder(batch_size=8, max_queue_size=4, name="small-queue")


def test_the_warning_points_at_the_line_that_made_the_proxy() -> None:
    """Past the subclass's own __init__ (Recorder's, in _support.py) and the library."""
    with pytest.warns(batchproxy.BatchSizeUnreachable) as caught:
        Recorder(batch_size=8, max_queue_size=4)
    assert caught[0].filename == __file__

    @batchproxy.batch(batch_size=8, max_queue_size=2)  # the decorator's line
    async def double(items: list[int]) -> list[int]:
        return [2 * item for item in items]

    with pytest.warns(batchproxy.BatchSizeUnreachable) as caught:
        double.configure(max_queue_size=1)
    assert caught[0].filename == __file__


@pytest.mark.parametrize("bound", [None, 8, 100])
def test_no_warning_when_a_full_batch_can_wait(bound: int | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", batchproxy.BatchSizeUnreachable)
        # slots do not matter: running batches do not count against the queue's bound
        Recorder(batch_size=8, max_queue_size=bound, max_concurrent_batches=4)


def test_configure_warns_too() -> None:
    p = Recorder(batch_size=8, max_queue_size=8)
    with pytest.warns(
        batchproxy.BatchSizeUnreachable, match="max_queue_size=8 is below batch_size=16"
    ):
        p.configure(batch_size=16)
    assert p.options.batch_size == 16  # a warning: the change applies


async def test_the_bound_really_caps_the_batches() -> None:
    """What the warning says, shown: with 4 waiting at most, no batch holds more."""
    p = Recorder(delay=0.01, batch_size=8, max_queue_size=4, max_concurrent_batches=1)

    async def call(n: int) -> object:
        try:
            return await p.inference(n)
        except batchproxy.QueueFull:
            return None

    results = await asyncio.gather(*(call(n) for n in range(13)))
    # the first call's batch takes what waits when it starts: four; the rest refused
    assert results.count(None) == 9
    assert p.batches == [[0, 1, 2, 3]]
    await p.aclose()


def test_serving_warns_when_the_servers_caller_limit_cannot_fill_the_slots() -> None:
    p = Recorder(batch_size=16, max_concurrent_batches=2, name="embed")
    with pytest.warns(
        batchproxy.BatchSizeUnreachable,
        match=r"lets 20 calls in at once, below batch_size x batch slots = 16 x 2 = 32, "
        r"so at most 1 of its 2 batch slots",
    ) as caught:
        Serving(p, max_callers=20)
    assert caught[0].filename == __file__
    with pytest.warns(batchproxy.BatchSizeUnreachable, match="no batch can hold more than 8 items"):
        Serving(p, max_callers=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", batchproxy.BatchSizeUnreachable)
        Serving(p, max_callers=32)
        Serving(p)


def test_serving_checks_max_callers() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Serving(max_callers=0)
    with pytest.raises(TypeError, match="an int or None"):
        Serving(max_callers=2.5)  # type: ignore[arg-type]
