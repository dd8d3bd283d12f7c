"""`RayActors`: batches on Ray actors, through a proxy and on their own.

One local Ray instance serves the whole module (it takes seconds to start). The
models are module-level factories, pickled by value: Ray's workers cannot import
this module (only pytest put tests/ on the path). Every actor asks for
a quarter CPU, so scaling to 3 fits the 2 CPUs given to Ray even while killed
actors are still giving theirs back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _support import (
    assert_settled,
    batchproxy_cycles,
    fails_with,
    in_a_task_of_its_own,
    peak_in_flight,
    wait_until,
)

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


def lock_for_marker() -> Any:
    """Each item back as it came, except "lock", which comes back as a lock (that Ray
    cannot serialize)."""
    import threading

    def model(items: list[Any]) -> list[Any]:
        return [threading.Lock() if item == "lock" else ("ok", item) for item in items]

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
    # both started first: a batch goes to a busy actor rather than wait for one still
    # starting if that one frees first (on a loaded machine, the second actor took
    # longer to start than the first batch's 0.2 s, and both batches went to one actor)
    await actors.start()
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
        ({"start_timeout": 0}, ValueError, "start_timeout must be"),
        ({"start_timeout": "60"}, TypeError, "start_timeout must be"),
        ({"health_check_period": -1}, ValueError, "health_check_period must be"),
        ({"health_check_period": 0}, ValueError, "health_check_period must be"),
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


# -- placement, routing, start deadlines, probes, health -------------------------------------


def hangs_if(marker: str) -> Any:
    """A factory that never returns while `marker` exists (a replica that cannot start,
    as on a cluster with no room for it); else `sleeper`."""

    def factory() -> Any:
        while Path(marker).exists():
            time.sleep(0.05)
        return sleeper()

    return factory


@pytest.mark.parametrize(
    ("actor_options", "error", "message"),
    [
        ([("resources", {})], TypeError, "actor_options must be a dict"),
        ({1: 2}, TypeError, "keys are Ray option names"),
        ({"num_cpus": 2}, ValueError, "cannot set 'num_cpus': pass num_cpus="),
        ({"name": "x"}, ValueError, "cannot set 'name'"),
        ({"lifetime": "detached"}, ValueError, "would outlive it"),
        ({"scheduling_strategy": "PACKED"}, ValueError, "'DEFAULT', 'SPREAD' or a Ray"),
        ({"resources": {"gpu_node": -1}}, ValueError, "finite number >= 0"),
        ({"resources": {"gpu_node": "1"}}, TypeError, "must be a number"),
        ({"resources": ["gpu_node"]}, TypeError, "'resources'\\] must be a dict"),
        ({"memory": 0}, ValueError, "number of bytes > 0"),
        ({"max_restarts": -2}, ValueError, "int >= -1"),
        ({"max_restarts": 1.5}, ValueError, "int >= -1"),
        ({"runtime_env": {"pip": 3}}, ValueError, "runtime_env'\\] is not valid"),
        ({"runtime_env": "env"}, TypeError, "'runtime_env'\\] must be a dict"),
        ({"no_such_option": 1}, ValueError, "Invalid option keyword no_such_option"),
        ({"resources": {"CPU": 1}}, ValueError, "num_cpus"),
    ],
)
def test_bad_actor_options_fail_when_the_pool_is_built(
    actor_options: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        RayActors(doubler, actor_options=actor_options)


def test_replicas_spread_over_nodes_unless_a_strategy_is_given() -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    assert RayActors(doubler)._replicas.options["scheduling_strategy"] == "SPREAD"
    pinned = NodeAffinitySchedulingStrategy(node_id="ab" * 28, soft=True)
    chosen = RayActors(doubler, actor_options={"scheduling_strategy": pinned})
    assert chosen._replicas.options["scheduling_strategy"] is pinned
    default = RayActors(doubler, actor_options={"scheduling_strategy": None})
    assert default._replicas.options["scheduling_strategy"] == "DEFAULT"
    options = RayActors(
        doubler, num_cpus=0.5, actor_options={"resources": {"gpu_node": 0.01}, "max_restarts": 2}
    )._replicas.options
    assert (options["num_cpus"], options["resources"], options["max_restarts"]) == (
        0.5,
        {"gpu_node": 0.01},
        2,
    )


async def test_actor_options_reach_every_replica() -> None:
    """A custom resource the local node lacks: the replica stays pending (Ray would
    wait for such a node), and the pool says so instead of waiting in silence."""
    actors = RayActors(
        doubler,
        1,
        num_cpus=CPU,
        actor_options={"resources": {"no_such_node": 1}},
        start_timeout=0.5,
    )
    try:
        with pytest.raises(TimeoutError, match=r"1 of 1 replicas not started after 0\.5 s"):
            await actors.start()
        assert (actors.stats.pending, actors.stats.overdue, actors.stats.ready) == (1, 1, 0)
        assert "0 ready, 1 pending" in repr(actors)
    finally:
        await actors.aclose()


async def test_a_retry_never_waits_on_a_replica_that_cannot_start(tmp_path: Path) -> None:
    """The stranded retry: a replica dies under load with retry_on_crash and more
    batches in flight than replicas; its replacement cannot start. The retried
    batch runs on the live replica, and every caller gets its result."""
    hang = tmp_path / "hang"
    async with (
        RayActors(hangs_if(str(hang)), 2, num_cpus=CPU, retry_on_crash=True) as actors,
        Proxy[Any, Any](offload=actors, batch_size=2, max_concurrent_batches=4) as proxy,
    ):
        hang.touch()  # replacements from now on never start
        call, pid = await sleeping_call(proxy, tmp_path / "marker")
        slow = [(0.3, str(tmp_path / f"slow{i}")) for i in range(12)]  # the survivor stays busy
        others = asyncio.ensure_future(asyncio.gather(*(proxy.inference(i) for i in slow)))
        await asyncio.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        rerun_pid, item = await asyncio.wait_for(call, 30)
        assert rerun_pid != pid
        assert item == (30.0, str(tmp_path / "marker"))
        results = await asyncio.wait_for(others, 30)
        assert [item for _, item in results] == slow
        stats = actors.stats
        assert (stats.ready, stats.pending, stats.lost) == (1, 1, 1)
        assert stats.retried >= 1  # the batch it ran, and any queued behind it
        assert proxy.stats.failed_batches == 0
        assert proxy.healthy  # one replica ready is enough to serve
        hang.unlink()
        await wait_until(lambda: actors.stats.ready == 2, seconds=30)  # joins once it can


async def test_no_replica_ready_in_time_fails_the_batch_and_shows_in_health(
    tmp_path: Path,
) -> None:
    hang = tmp_path / "hang"
    hang.touch()
    actors = RayActors(hangs_if(str(hang)), 1, num_cpus=CPU, start_timeout=0.3)
    proxy = Proxy[Any, Any](offload=actors, batch_size=4)
    try:
        assert proxy.healthy  # not started: nothing wrong yet
        with pytest.raises(batchproxy.PoolUnavailable, match=r"no replica ready .* after 0\.3 s"):
            await asyncio.wait_for(proxy.inference(1), 10)
        assert not actors.health.healthy
        assert "no replica ready (1 pending" in str(actors.health.reason)
        assert proxy.health == actors.health  # what a readiness route reads
        assert actors.stats.overdue == 1
        hang.unlink()  # the pending replica comes up after all
        await wait_until(lambda: actors.stats.ready == 1, seconds=30)
        assert proxy.healthy
        assert await asyncio.wait_for(proxy.inference(2), 10) == (await proxy.inference(2))
    finally:
        await proxy.aclose()
        await actors.aclose()
    assert not actors.health.healthy
    assert actors.health.reason == "RayActors is closed"


async def test_a_replica_lost_while_idle_leaves_the_rotation_before_a_batch_reaches_it() -> None:
    async with (
        RayActors(doubler, 2, num_cpus=CPU, health_check_period=0.2) as actors,
        Proxy[Any, Any](offload=actors, batch_size=1) as proxy,
    ):
        pids = {pid for pid, _ in await asyncio.gather(*(proxy.inference(i) for i in range(8)))}
        assert len(pids) == 2
        victim = pids.pop()
        os.kill(victim, signal.SIGKILL)
        await wait_until(lambda: actors.stats.lost == 1, seconds=10)  # by a probe
        results = await asyncio.gather(*(proxy.inference(i) for i in range(20)))
        assert [doubled for _, doubled in results] == [i * 2 for i in range(20)]
        assert victim not in {pid for pid, _ in results}
        assert proxy.stats.failed_batches == 0  # no batch was sent to the dead one
        await wait_until(lambda: actors.stats.ready == 2, seconds=30)  # replaced


async def test_an_unavailable_replica_takes_no_batch_until_a_probe_is_answered() -> None:
    from ray.exceptions import ActorUnavailableError

    async with RayActors(doubler, 2, num_cpus=CPU, health_check_period=60) as actors:
        first, second = actors._replicas.rotation
        actors._replicas.unavailable(first, ActorUnavailableError("connection lost", None))
        assert (actors.stats.ready, actors.stats.unavailable) == (1, 1)
        served = [await actors.run(None, [i]) for i in range(4)]  # type: ignore[arg-type]
        assert {pid for [(pid, _)] in served} == {await_pid(second)}
        await actors._replicas.probe(first, 5.0)  # it answers: back in rotation
        assert (actors.stats.ready, actors.stats.unavailable, actors.stats.lost) == (2, 0, 0)


def await_pid(replica: Any) -> int:
    results, _sent = ray.get(replica.handle.run.remote([0], -1))  # (-1: a token of its own)
    return int(results[0][0])


async def test_a_replica_that_never_answers_probes_is_replaced() -> None:
    never = types.SimpleNamespace(future=concurrent.futures.Future)
    silent = types.SimpleNamespace(ready=types.SimpleNamespace(remote=lambda: never))

    async with RayActors(doubler, 1, num_cpus=CPU, health_check_period=60) as actors:
        replica = actors._replicas.rotation[0]
        real = replica.handle
        replica.handle = silent  # its probes are never answered
        for _ in range(2):
            await actors._replicas.probe(replica, 0.05)
        assert (actors.stats.unavailable, actors.stats.lost) == (1, 0)
        await actors._replicas.probe(replica, 0.05)
        assert actors.stats.lost == 1
        assert replica not in actors._replicas.rotation
        ray.kill(real)
        await wait_until(lambda: actors.stats.ready == 1, seconds=30)


async def test_the_autoscaler_follows_the_load_and_the_proxy_follows_it() -> None:
    from batchproxy import Autoscaling

    scaling = Autoscaling(
        min_replicas=1,
        max_replicas=3,
        upscale_delay=0.2,
        downscale_delay=0.5,
        interval=0.05,
    )
    async with (
        RayActors(slow_doubler, 1, num_cpus=CPU, autoscaling=scaling) as actors,
        Proxy[Any, Any](offload=actors, batch_size=2) as proxy,
    ):
        load = asyncio.ensure_future(asyncio.gather(*(proxy.inference(i) for i in range(120))))
        await wait_until(lambda: actors.num_replicas == 3, seconds=20)
        assert proxy.stats.max_in_flight == 3  # the proxy follows the capacity
        results = await asyncio.wait_for(load, 30)
        assert [doubled for _, doubled in results] == [i * 2 for i in range(120)]
        await wait_until(lambda: actors.num_replicas == 1, seconds=20)  # idle: back to min
        stats = actors.stats.autoscaler
        assert stats is not None
        assert stats.scale_ups >= 1
        assert stats.scale_downs >= 1
        assert actors.autoscale_load() == 0


def test_autoscaling_needs_its_range_to_hold_num_replicas() -> None:
    from batchproxy import Autoscaling

    with pytest.raises(
        ValueError, match=r"to begin with, 1, is outside the autoscaling range \[2, 4\]"
    ):
        RayActors(doubler, 1, autoscaling=Autoscaling(min_replicas=2, max_replicas=4))
    with pytest.raises(TypeError, match=r"must be a batchproxy\.Autoscaling"):
        RayActors(doubler, 1, autoscaling={"max_replicas": 2})  # type: ignore[arg-type]


async def test_without_probes_an_unavailable_replica_is_replaced() -> None:
    from ray.exceptions import ActorUnavailableError

    async with RayActors(doubler, 1, num_cpus=CPU, health_check_period=None) as actors:
        replica = actors._replicas.rotation[0]
        actors._replicas.unavailable(replica, ActorUnavailableError("connection lost", None))
        assert actors.stats.lost == 1
        assert replica not in actors._replicas.rotation
        [(pid, doubled)] = await actors.run(None, [3])  # type: ignore[arg-type]
        assert doubled == 6
        assert alive(pid)


async def test_prometheus_exports_a_real_pool() -> None:
    prometheus = pytest.importorskip("prometheus_client")
    from batchproxy.integrations.prometheus import PrometheusMetrics, render

    metrics = PrometheusMetrics(registry=prometheus.CollectorRegistry())
    async with RayActors(doubler, 2, num_cpus=CPU, name="embed") as actors:
        metrics.instrument_pool(actors)
        text = render(metrics.registry).decode()
        for state, value in (("target", 2), ("ready", 2), ("pending", 0)):
            assert f'batchproxy_pool_replicas{{pool="embed",state="{state}"}} {value}.0' in text


# -- items and results that cannot travel (issue 27, item 11) --------------------------------


async def test_an_item_ray_cannot_serialize_fails_only_its_caller() -> None:
    """It failed the whole batch with Ray's "Could not serialize the argument"."""
    async with (
        RayActors(lock_for_marker, 1, num_cpus=CPU) as actors,
        Proxy[Any, Any](offload=actors, batch_size=4, max_delay_ms=500) as proxy,
    ):
        items: list[Any] = ["a", threading.Lock(), "c", lambda: None]
        results = await asyncio.gather(*map(proxy.inference, items), return_exceptions=True)
        assert proxy.stats.batches == 1
        assert results[0] == ("ok", "a")
        assert results[2] == ("ok", "c")
        assert results[3][0] == "ok"  # a lambda travels
        assert isinstance(results[1], TypeError)
        assert "_thread.lock" in str(results[1])
        assert await proxy.inference("d") == ("ok", "d")


async def test_a_result_ray_cannot_send_back_fails_only_its_caller() -> None:
    """It failed the whole batch with the actor's "cannot pickle '_thread.lock'"."""
    async with (
        RayActors(lock_for_marker, 1, num_cpus=CPU) as actors,
        Proxy[Any, Any](offload=actors, batch_size=4, max_delay_ms=500) as proxy,
    ):
        items = ["a", "lock", "c", "d"]
        results = await asyncio.gather(*map(proxy.inference, items), return_exceptions=True)
        assert proxy.stats.batches == 1
        assert [results[0], results[2], results[3]] == [("ok", "a"), ("ok", "c"), ("ok", "d")]
        assert isinstance(results[1], TypeError)
        assert "_thread.lock" in str(results[1])
        assert "return from its Ray actor" in str(results[1])


async def test_calls_on_ray_actors_leave_no_reference_cycle() -> None:
    """Results and an item the model refuses are freed by reference counting (see
    `tests/calls/test_hot_path.py`: what a cycle costs under load). Not an error for
    the whole batch: Ray's `RayTaskError(KeyError)` is a class made for it and holds
    its cause, whose `__cause__` it is, so that error is in a cycle of Ray's making,
    and so is whatever its traceback holds until a collection finds it."""
    async with (
        RayActors(picky, 1, num_cpus=CPU) as actors,
        Proxy[Any, Any](offload=actors, batch_size=8) as proxy,
    ):
        assert await proxy.inference(0) == ("ok", 0)

        async def calls() -> None:
            assert await asyncio.gather(*(proxy.inference(i) for i in range(6))) == [
                ("ok", i) for i in range(6)
            ]
            await fails_with(proxy.inference("bad"), ValueError)

        with batchproxy_cycles() as cycles:
            await in_a_task_of_its_own(calls())
            for _ in range(3):
                await asyncio.sleep(0.01)
        assert cycles == []
