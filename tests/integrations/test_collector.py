"""A service and the garbage collector: `Serving` freezes what loading left alive by
default and gives it back when the last service that froze closes (a lone request
through a FastAPI service leaves no garbage: `test_fastapi.py`)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest
from _support import Recorder, nothing_frozen

from batchproxy import WorkerThread
from batchproxy.integrations._serving import NotReady, Serving


class _Weights:
    """Stands for a loaded model: objects the collector tracks."""

    def __init__(self) -> None:
        self.layers = [{"w": [0.0] * 4} for _ in range(1_000)]


def _tracked(thing: object) -> bool:
    """Whether the collector's passes walk `thing` (`get_objects` leaves out the frozen)."""
    return any(thing is other for other in gc.get_objects())


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    """Each test starts and ends with nothing frozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


async def test_by_default_it_freezes_what_loading_left_alive_before_it_reports_ready() -> None:
    loaded: list[_Weights] = []
    frozen_while_loading: list[int] = []

    async def load() -> None:
        loaded.append(_Weights())
        frozen_while_loading.append(gc.get_freeze_count())

    thread = WorkerThread(name="shared")  # (with the other options it meets)
    serving = Serving(Recorder(offload=thread), executors=[thread], load=load, drain_timeout=5)
    assert serving.freeze_gc
    async with serving.running():
        await serving.wait_ready()
        assert gc.get_freeze_count() >= frozen_while_loading[0] + 1_000
        # the model's objects are frozen: a full pass no longer walks them
        assert not _tracked(loaded[0].layers[0])
        assert serving.readiness().status == 200
        assert await serving.proxies[0].inference(1) == ("out", 1)  # calls go on as before


async def test_what_loading_left_as_garbage_is_freed_not_frozen() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    dropped: list[weakref.ref[Cycle]] = []

    async def load() -> None:
        dropped.append(weakref.ref(Cycle()))  # garbage only a collection frees

    async with Serving(Recorder(), load=load).running() as serving:
        await serving.wait_ready()
        assert gc.get_freeze_count() > 0
        assert dropped[0]() is None


async def test_the_freeze_is_given_back_when_the_last_service_that_froze_closes() -> None:
    """A process that outlives its services (a test suite, a notebook, an app restarted in
    one process) keeps nothing frozen: what was alive at the freeze and became garbage
    since is the collector's again."""
    weights = [_Weights(), _Weights()]
    first, second = Serving(Recorder(name="a")), Serving(Recorder(name="b"))
    await first.start()
    await first.wait_ready()
    await second.start()
    await second.wait_ready()
    assert not _tracked(weights[0].layers[0])
    await first.aclose()
    assert gc.get_freeze_count() > 0  # the second still serves: still frozen
    assert not _tracked(weights[0].layers[0])
    await second.aclose()
    assert _tracked(weights[0].layers[0])
    await second.aclose()  # (idempotent: nothing given back twice)
    assert nothing_frozen()


async def test_with_freeze_gc_false_or_after_a_failed_load_nothing_is_frozen() -> None:
    async def fails() -> None:
        raise OSError("weights not found")

    for serving in (Serving(Recorder(), freeze_gc=False), Serving(Recorder(), load=fails)):
        async with serving.running():
            with contextlib.suppress(NotReady):
                await serving.wait_ready()
            assert nothing_frozen()


def test_freeze_gc_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="freeze_gc must be a bool"):
        Serving(Recorder(), freeze_gc=1)  # type: ignore[arg-type]
