"""`RayActors`: batches on Ray actors, through a proxy and on their own.

One local Ray instance serves the whole module (it takes seconds to start). The
models are module-level factories, pickled by value: Ray's workers cannot import
this module (only pytest put tests/ on the path). Every actor asks for
a quarter CPU, so scaling to 3 fits the 2 CPUs given to Ray even while killed
actors are still giving theirs back.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _support import assert_settled, peak_in_flight, wait_until

import batchproxy
from batchproxy import Proxy, WorkerDied

ray = pytest.importorskip("ray")

from batchproxy.integrations.ray import RayActors  # noqa: E402 - needs ray

CPU = 0.25


@pytest.fixture(scope="module", autouse=True)
def ray_instance() -> Iterator[None]:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


# -- models (module level: Ray pickles the factories) --------------------------------------


def doubler() -> Any:
    def model(items: list[int]) -> list[tuple[int, int]]:
        time.sleep(0.01)
        return [(os.getpid(), item * 2) for item in items]

    return model


def slow_doubler() -> Any:
    async def model(items: list[int]) -> list[tuple[int, int]]:  # an awaitable result
        await asyncio.sleep(0.1)
        return [(os.getpid(), item * 2) for item in items]

    return model


def picky() -> Any:
    """Raises KeyError for a batch holding "boom"; answers "bad" with a ValueError."""

    def model(items: list[Any]) -> list[Any]:
        if "boom" in items:
            raise KeyError("boom")
        return [ValueError(f"bad item {i}") if i == "bad" else ("ok", i) for i in items]

    return model


def sleeper() -> Any:
    """An item `(seconds, marker)` writes the pid to `marker` and sleeps, the first time."""

    def model(items: list[Any]) -> list[tuple[int, Any]]:
        for item in items:
            if isinstance(item, tuple):
                seconds, marker = item
                path = Path(marker)
                if not path.exists():
                    path.write_text(str(os.getpid()))
                    time.sleep(seconds)
        return [(os.getpid(), item) for item in items]

    return model


def cancellable() -> Any:
    """An item `(started, cancelled)`: writes `started`, then waits; on cancellation
    writes `cancelled`."""

    async def model(items: list[tuple[str, str]]) -> list[int]:
        started, cancelled = items[0]
        touch(started)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            touch(cancelled)
            raise
        return [os.getpid()]

    return model


def broken() -> Any:
    raise LookupError("no weights here")


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def wait_dead(*pids: int) -> None:
    await wait_until(lambda: not any(alive(pid) for pid in pids), seconds=15)


def touch(path: str) -> None:
    Path(path).touch()


def read_pid(marker: Path) -> int:
    return int(marker.read_text())


async def sleeping_call(proxy: Proxy[Any, Any], marker: Path) -> tuple[asyncio.Future[Any], int]:
    """Send a batch that sleeps 30 s; return its call once it runs, and its actor's pid."""
    call = asyncio.ensure_future(proxy.inference((30.0, str(marker))))
    await wait_until(marker.exists, seconds=30)
    await asyncio.sleep(0.05)  # the pid is written
    return call, read_pid(marker)


async def killed_mid_batch(proxy: Proxy[Any, Any], marker: Path) -> tuple[int, Any]:
    """Send a sleeping batch, SIGKILL its actor once it runs; return (pid, outcome)."""
    call, pid = await sleeping_call(proxy, marker)
    os.kill(pid, signal.SIGKILL)
    try:
        return pid, await call
    except Exception as exc:
        return pid, exc


# -- tests --------------------------------------------------------------------------------


async def test_many_callers_each_get_their_own_result_from_both_actors() -> None:
    async with RayActors(doubler, 2, num_cpus=CPU) as actors:
        assert actors.capacity == 2
        async with Proxy[int, tuple[int, int]](offload=actors, batch_size=8) as proxy:
            results = await asyncio.gather(*(proxy.inference(i) for i in range(200)))
            assert [doubled for _, doubled in results] == [2 * i for i in range(200)]
            assert len({pid for pid, _ in results}) == 2
            stats = proxy.stats
            assert_settled(stats)
            assert stats.batches < 200  # they were batched
            assert stats.succeeded == 200
        assert "2 ready" in repr(actors)
    assert "closed" in repr(actors)


async def test_model_errors_fail_their_batch_or_their_item_and_serving_goes_on() -> None:
    async with RayActors(picky, 2, num_cpus=CPU) as actors:
        with pytest.raises(KeyError, match="boom") as raised:  # the whole batch, direct
            await actors.run(None, ["boom", 1])  # type: ignore[arg-type]
        assert type(raised.value) is KeyError
        assert isinstance(raised.value.__cause__, ray.exceptions.RayTaskError)
        results = await actors.run(None, [1, "bad", 2])  # type: ignore[arg-type]
        assert results[0] == ("ok", 1)
        assert type(results[1]) is ValueError
        assert results[2] == ("ok", 2)

        async with Proxy[Any, Any](offload=actors, batch_size=8) as proxy:
            with pytest.raises(KeyError, match="boom"):
                await proxy.inference("boom")
            outcomes = await asyncio.gather(
                *(proxy.inference(x) for x in [1, "bad", 2, "bad", 3]), return_exceptions=True
            )
            assert [type(o).__name__ for o in outcomes] == [
                "tuple", "ValueError", "tuple", "ValueError", "tuple"
            ]  # fmt: skip
            assert await proxy.inference(4) == ("ok", 4)
            assert proxy.stats.failed_batches == 1


async def test_a_factory_error_reaches_start_and_the_batches() -> None:
    actors = RayActors(broken, 1, num_cpus=CPU)
    try:
        with pytest.raises(LookupError, match="no weights"):
            await actors.start()
        with pytest.raises(LookupError, match="no weights"):  # a new actor is tried
            await actors.run(None, [1])  # type: ignore[arg-type]
    finally:
        await actors.aclose()


async def test_an_actor_killed_mid_batch_fails_that_batch_alone_and_is_replaced(
    tmp_path: Path, no_leftovers: None
) -> None:
    async with (
        RayActors(sleeper, 2, num_cpus=CPU) as actors,
        Proxy[Any, Any](offload=actors, batch_size=4) as proxy,
    ):
        call, pid = await sleeping_call(proxy, tmp_path / "marker")
        others_running = asyncio.gather(*(proxy.inference(i) for i in range(20)))
        await asyncio.sleep(0.02)  # they run on the other actor meanwhile
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDied) as raised:
            await call
        outcome = raised.value
        others = await others_running
        assert outcome.items == 1
        assert "ActorDiedError" in outcome.detail
        assert "actor " in outcome.worker
        assert [item for _, item in others] == list(range(20))
        assert pid not in {other for other, _ in others}

        later = await asyncio.gather(*(proxy.inference(i) for i in range(20)))  # replaced
        assert [item for _, item in later] == list(range(20))
        assert pid not in {other for other, _ in later}
        assert actors.capacity == 2
        assert proxy.stats.failed_batches == 1
        await wait_dead(pid)


async def test_a_lone_actor_killed_is_replaced_and_serves_again(tmp_path: Path) -> None:
    async with (
        RayActors(sleeper, 1, num_cpus=CPU) as actors,
        Proxy[Any, Any](offload=actors, batch_size=4) as proxy,
    ):
        first_pid, _ = await proxy.inference(0)
        pid, outcome = await killed_mid_batch(proxy, tmp_path / "marker")
        assert pid == first_pid
        assert isinstance(outcome, WorkerDied), outcome
        new_pid, answer = await proxy.inference(1)  # waits for the replacement
        assert (answer, actors.capacity) == (1, 1)
        assert new_pid != pid


async def test_retry_on_crash_reruns_the_batch_on_another_actor(tmp_path: Path) -> None:
    async with (
        RayActors(sleeper, 2, num_cpus=CPU, retry_on_crash=True) as actors,
        Proxy[Any, Any](offload=actors, batch_size=4) as proxy,
    ):
        marker = tmp_path / "marker"
        pid, outcome = await killed_mid_batch(proxy, marker)
        rerun_pid, item = outcome  # the caller got the result, not an error
        assert item == (30.0, str(marker))
        assert rerun_pid != pid
        results = await asyncio.gather(*(proxy.inference(i) for i in range(20)))
        assert [item for _, item in results] == list(range(20))
        assert proxy.stats.failed_batches == 0


async def test_scale_changes_capacity_and_the_proxy_follows() -> None:
    async def run(proxy: Proxy[int, tuple[int, int]], calls: int) -> tuple[int, set[int]]:
        """Make `calls` concurrent calls; return the most batches seen in flight, and pids."""
        most, results = await peak_in_flight(proxy, range(calls))
        assert [doubled for _, doubled in results] == [2 * i for i in range(calls)]
        return most, {pid for pid, _ in results}

    async with (
        RayActors(slow_doubler, 2, num_cpus=CPU) as actors,
        Proxy[int, tuple[int, int]](offload=actors, batch_size=1) as proxy,
    ):
        most, pids = await run(proxy, 8)
        assert (most, len(pids)) == (2, 2)

        await actors.scale(1)
        assert actors.capacity == 1
        most, (kept,) = await run(proxy, 4)
        assert most == 1
        await wait_dead(*(pids - {kept}))  # the removed actor is killed

        await actors.scale(3)
        assert actors.capacity == 3
        most, pids = await run(proxy, 12)
        assert (most, len(pids)) == (3, 3)
        assert kept in pids

        calls = [asyncio.ensure_future(proxy.inference(i)) for i in range(6)]
        await asyncio.sleep(0.05)
        await actors.scale(1)  # removed actors finish their batches first
        assert [doubled for _, doubled in await asyncio.gather(*calls)] == [0, 2, 4, 6, 8, 10]
        assert_settled(proxy.stats)


async def test_aclose_kills_every_actor_and_refuses_batches(tmp_path: Path) -> None:
    actors = RayActors(sleeper, 2, num_cpus=CPU, name="closing")
    first, second = await asyncio.gather(
        actors.run(None, [(0.2, str(tmp_path / "a"))]),  # type: ignore[arg-type]
        actors.run(None, [(0.2, str(tmp_path / "b"))]),  # type: ignore[arg-type]
    )
    pids = {first[0][0], second[0][0]}
    assert len(pids) == 2  # the second went to the idle actor

    marker = tmp_path / "long"
    running = asyncio.ensure_future(actors.run(None, [(30.0, str(marker))]))  # type: ignore[arg-type]
    await wait_until(marker.exists, seconds=30)
    started = time.monotonic()
    await actors.aclose(timeout=0.2)
    assert time.monotonic() - started < 5
    with pytest.raises(RuntimeError, match="closing was closed while it ran this batch"):
        await running
    await wait_dead(*pids)
    await actors.aclose()  # idempotent
    assert actors.closed
    with pytest.raises(RuntimeError, match="closing is closed"):
        await actors.run(None, [1])  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="closing is closed"):
        await actors.scale(2)


async def test_aclose_lets_running_batches_end() -> None:
    actors = RayActors(slow_doubler, 1, num_cpus=CPU)
    call = asyncio.ensure_future(actors.run(None, [1, 2]))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    await actors.aclose()
    assert [doubled for _, doubled in await call] == [2, 4]


async def test_a_cancelled_run_cancels_the_actor_task(tmp_path: Path, no_leftovers: None) -> None:
    async with RayActors(cancellable, 1, num_cpus=CPU) as actors:
        started, cancelled = tmp_path / "started", tmp_path / "cancelled"
        call = asyncio.ensure_future(actors.run(None, [(str(started), str(cancelled))]))  # type: ignore[arg-type]
        await wait_until(started.exists, seconds=30)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await wait_until(cancelled.exists, seconds=10)  # ray.cancel reached the model
        assert "0 batches in flight" in repr(actors)


async def test_unstarted_executor_creates_nothing_and_scales_lazily() -> None:
    actors = RayActors(doubler, 1, num_cpus=CPU)
    assert "not started" in repr(actors)
    await actors.scale(2)
    assert (actors.capacity, actors.num_replicas) == (2, 2)
    assert "not started" in repr(actors)
    await actors.aclose()
    await actors.aclose()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"factory": 42}, TypeError, "factory must be a callable"),
        ({"num_replicas": 0}, ValueError, "num_replicas must be >= 1"),
        ({"num_replicas": 1.5}, TypeError, "num_replicas must be an int"),
        ({"num_replicas": True}, TypeError, "num_replicas must be an int"),
        ({"num_cpus": -1}, ValueError, "num_cpus must be a finite number >= 0"),
        ({"num_cpus": "1"}, TypeError, "num_cpus must be a number"),
        ({"num_gpus": math.nan}, ValueError, "num_gpus must be a finite number >= 0"),
        ({"num_gpus": None}, TypeError, "num_gpus must be a number"),
        ({"retry_on_crash": 1}, TypeError, "retry_on_crash must be a bool"),
        ({"name": ""}, TypeError, "name must be a non-empty str"),
    ],
)
def test_bad_arguments(options: dict[str, Any], error: type[Exception], message: str) -> None:
    arguments: dict[str, Any] = {"factory": doubler, **options}
    with pytest.raises(error, match=message):
        RayActors(**arguments)


async def test_bad_scale_and_a_proxy_with_a_model_of_its_own() -> None:
    actors = RayActors(doubler, 1, num_cpus=CPU)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        await actors.scale(0)

    class Own(batchproxy.Proxy[int, int]):
        async def _inference(self, items: list[int]) -> list[int]:
            return items

    with pytest.raises(TypeError, match="runs a model of its own"):
        Own(offload=actors)
    await actors.aclose()


async def test_aclose_checks_its_timeout() -> None:
    actors = RayActors(slow_doubler, 1, num_cpus=CPU)
    for bad, error in ((-1, ValueError), (float("nan"), ValueError), ("1", TypeError)):
        with pytest.raises(error, match="timeout must be"):
            await actors.aclose(timeout=bad)  # type: ignore[arg-type]
    assert not actors.closed  # a refused call changes nothing
    await actors.aclose(timeout=1e10)  # clamped like every duration
    assert actors.closed
