"""`RayActors` on a real Ray cluster of two nodes on this machine (`_ray_cluster`).

One cluster serves the module: a head (node_a, 127.0.0.2) and a second node
(127.0.0.3), 4 CPUs each, with fast failure detection (a lost node is declared
dead in about 2 s). A test that kills the second node leaves it dead; the next
test starts a fresh second node (the `cluster` fixture). After every test no
actor of this driver may be left alive.

Placement, whatever the scheduling strategy: a replica of 3 CPUs leaves no room
for a second one on a 4-CPU node, so two replicas take one node each, and a
replacement has nowhere to go once a node is lost. For a replacement that has
room, blocker actors first take 2 CPUs of each node (pinned by the nodes' custom
resources). Only the first test and the autoscaling test count on the pool's own
spreading (`scheduling_strategy="SPREAD"`, its default), with 1-CPU replicas.

The models are module-level factories, pickled by value (Ray's workers cannot
import this module). Every wait is bounded: a caller that hangs fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import pytest
from _support import assert_settled

from batchproxy import Autoscaling, Proxy, WorkerDied

ray = pytest.importorskip("ray")

from _ray_cluster import RayCluster, RayNode  # noqa: E402 - needs ray
from ray._private import state as ray_state  # noqa: E402

from batchproxy.integrations.ray import RayActors  # noqa: E402 - needs ray

Result = tuple[int, str, int]
"""What the models answer per item: (item * 2, the node it ran on, the actor's pid)."""

AFTER_LOSS = 30.0
"""Seconds every caller has to get its outcome once a node is lost (detection: ~2 s)."""


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with RayCluster(cpus=(4, 4)) as cluster:
        yield cluster


@pytest.fixture
def cluster(ray_cluster: RayCluster) -> Iterator[RayCluster]:
    """The module's cluster with a live second node (a new one if a test killed it);
    after the test, no actor of this driver may be left alive."""
    if ray_cluster.second.killed:
        ray_cluster.add_node()
    before = set(actors_of_this_job())
    yield ray_cluster
    deadline = time.monotonic() + 10
    while alive := {a: s for a, (s, _) in actors_of_this_job(before).items() if s != "DEAD"}:
        assert time.monotonic() < deadline, f"actors left behind: {alive}"
        time.sleep(0.1)


# -- models (module level: Ray pickles the factories) --------------------------------------


def tagged() -> Any:
    def model(items: list[int]) -> list[Result]:
        time.sleep(0.005)
        node = ray.get_runtime_context().get_node_id()
        return [(2 * item, node, os.getpid()) for item in items]

    return model


def slow_tagged() -> Any:
    async def model(items: list[int]) -> list[Result]:
        await asyncio.sleep(0.1)
        node = ray.get_runtime_context().get_node_id()
        return [(2 * item, node, os.getpid()) for item in items]

    return model


def holding(folder: str, hold_on: str) -> Any:
    """Answers like `tagged`, after 50 ms; each batch leaves `<id>.start` (its node and
    items) in `folder` when it starts and `<id>.end` when it ends. On node `hold_on`,
    while `folder/hold` exists, a batch waits before it ends: what that node holds
    when it is lost is known exactly."""
    directory = Path(folder)

    async def model(items: list[int]) -> list[Result]:
        node = ray.get_runtime_context().get_node_id()
        batch = directory / uuid.uuid4().hex
        draft = batch.with_suffix(".draft")
        draft.write_text(json.dumps({"node": node, "items": items}))
        draft.rename(batch.with_suffix(".start"))
        await asyncio.sleep(0.05)
        while node == hold_on and (directory / "hold").exists():  # noqa: ASYNC110 - a file
            await asyncio.sleep(0.01)
        batch.with_suffix(".end").touch()
        return [(2 * item, node, os.getpid()) for item in items]

    return model


# -- helpers --------------------------------------------------------------------------------


def actors_of_this_job(since: AbstractSet[str] = frozenset()) -> dict[str, tuple[str, str]]:
    """Actor id -> (state, node id) of the actors this driver created, but those in
    `since`. From the GCS's actor table (the state API needs the full dashboard)."""
    job = ray.get_runtime_context().get_job_id()
    return {
        actor: (info["State"], info["Address"]["NodeID"])
        for actor, info in ray_state.actors().items()
        if info["JobID"] == job and actor not in since
    }


class Blocker:
    """An actor that only takes resources."""

    def ready(self) -> bool:
        return True


async def occupy(node: RayNode, cpus: float) -> Any:
    """An actor holding `cpus` CPUs of `node` (pinned there by its custom resource)."""
    blocker = ray.remote(num_cpus=cpus, resources={node.name: 0.01})(Blocker).remote()
    assert await asyncio.wait_for(blocker.ready.remote(), 30)
    return blocker


async def poll(condition: Callable[[], bool], seconds: float, message: str) -> None:
    """Wait for `condition` (checked every 20 ms: some read files) for `seconds` at most."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not condition():
        assert loop.time() < end, message
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def serving(actors: RayActors, **options: Any) -> AsyncIterator[Proxy[int, Result]]:
    """A proxy on `actors`. On exit the pool closes first (briefly), so a batch stuck on
    a replica fails instead of keeping the proxy's close waiting; then the proxy."""
    proxy = Proxy[int, Result](offload=actors, **options)
    try:
        yield proxy
    finally:
        await actors.aclose(timeout=1)
        await asyncio.wait_for(proxy.aclose(), 30)


def batches(folder: Path, node: str) -> tuple[dict[str, list[int]], set[str]]:
    """The batches `holding` started on `node` (id -> items), and the ids of those ended."""
    started = {}
    for path in folder.glob("*.start"):
        record = json.loads(path.read_text())
        if record["node"] == node:
            started[path.stem] = record["items"]
    return started, {path.stem for path in folder.glob("*.end")}


def ended_on(folder: Path, node: str) -> set[str]:
    """The ids of the batches `holding` started on `node` and ended."""
    started, ended = batches(folder, node)
    return ended & started.keys()


def started_after(folder: Path, moment: float) -> int:
    """How many batches `holding` started after `moment` (a `time.time()`)."""
    return sum(path.stat().st_mtime > moment for path in folder.glob("*.start"))


def running(folder: Path, node: str) -> dict[str, list[int]]:
    started, ended = batches(folder, node)
    return {batch: items for batch, items in started.items() if batch not in ended}


async def holding_steadily(folder: Path, node: str) -> None:
    """Wait until `node` runs batches and the same ones for 0.3 s (longer than a batch):
    they are held, and no batch of that node is between its end and its answer."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    held: set[str] = set()
    since = loop.time()
    while True:
        now = set(running(folder, node))
        if now != held:
            held, since = now, loop.time()
        elif held and loop.time() - since >= 0.3:
            return
        assert loop.time() < end, f"{node} never held a batch steadily"
        await asyncio.sleep(0.02)


# -- tests ------------------------------------------------------------------------------------


async def test_replicas_spread_over_both_nodes(cluster: RayCluster) -> None:
    """1-CPU replicas would all fit on the head: the pool spreads them itself."""
    before = set(actors_of_this_job())
    async with RayActors(tagged, 2, num_cpus=1) as actors:
        await asyncio.wait_for(actors.start(), 60)
        placed = {node for _, node in actors_of_this_job(before).values()}
        assert placed == {cluster.head.node_id, cluster.second.node_id}
        async with serving(actors, batch_size=2) as proxy:
            results = await asyncio.wait_for(
                asyncio.gather(*(proxy.inference(i) for i in range(40))), 30
            )
        assert {node for _, node, _ in results} == placed


async def test_many_callers_each_get_their_own_result_from_both_nodes(
    cluster: RayCluster,
) -> None:
    """500 callers at once, in batches over one replica per node."""
    async with (
        RayActors(tagged, 2, num_cpus=3) as actors,
        serving(actors, batch_size=16) as proxy,
    ):
        results = await asyncio.wait_for(
            asyncio.gather(*(proxy.inference(i) for i in range(500))), 60
        )
        assert [doubled for doubled, _, _ in results] == [2 * i for i in range(500)]
        served = {node for _, node, _ in results}
        assert served == {cluster.head.node_id, cluster.second.node_id}
        stats = proxy.stats
        assert_settled(stats)
        assert stats.succeeded == 500
        assert stats.batches < 500  # they were batched


async def test_aclose_kills_every_actor_of_the_pool_even_a_pending_one(
    cluster: RayCluster,
) -> None:
    """Two replicas running and a third that the cluster has no room for: after
    `aclose()` the GCS lists all three dead."""
    before = set(actors_of_this_job())
    actors = RayActors(tagged, 2, num_cpus=3)
    try:
        await asyncio.wait_for(actors.start(), 60)
        assert len(await actors.run(None, [1, 2])) == 2  # type: ignore[arg-type]
        scaling = asyncio.ensure_future(actors.scale(3))  # no room left for a third
        await poll(lambda: len(actors_of_this_job(before)) == 3, 10, "no third actor")
        states = sorted(state for state, _ in actors_of_this_job(before).values())
        assert states == ["ALIVE", "ALIVE", "PENDING_CREATION"]
    finally:
        await asyncio.wait_for(actors.aclose(), 30)
    with contextlib.suppress(Exception):  # ended by the close, however the pool says it
        await asyncio.wait_for(scaling, 10)
    await poll(
        lambda: {state for state, _ in actors_of_this_job(before).values()} == {"DEAD"},
        10,
        f"actors alive after aclose: {actors_of_this_job(before)}",
    )
    assert len(actors_of_this_job(before)) == 3


async def test_autoscaling_adds_replicas_on_both_nodes_and_scales_back(
    cluster: RayCluster,
) -> None:
    """Under sustained load the pool grows to its most replicas, spread over both
    nodes; once the load stops it shrinks back to its fewest, the others killed."""
    autoscaling = Autoscaling(
        min_replicas=1,
        max_replicas=3,
        target_batches_per_replica=1.0,
        upscale_delay=0.5,
        downscale_delay=2.0,
        interval=0.1,
    )
    before = set(actors_of_this_job())
    results: list[Result] = []
    stop = asyncio.Event()
    async with (
        RayActors(slow_tagged, 1, num_cpus=1, autoscaling=autoscaling) as actors,
        serving(actors, batch_size=4) as proxy,
    ):
        await asyncio.wait_for(actors.start(), 60)

        async def caller(item: int) -> None:
            while not stop.is_set():
                results.append(await proxy.inference(item))

        callers = [asyncio.ensure_future(caller(i)) for i in range(32)]
        both = {cluster.head.node_id, cluster.second.node_id}
        try:
            await poll(
                lambda: actors.num_replicas == 3 and {r[1] for r in results} == both,
                30,
                f"no scale-up to 3 replicas serving on both nodes: {actors!r}",
            )
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*callers), 30)
        await poll(
            lambda: actors.num_replicas == 1 and actors.stats.ready == 1,
            20,
            f"no scale-down to 1 replica: {actors!r}",
        )
        await poll(
            lambda: [s for s, _ in actors_of_this_job(before).values()].count("ALIVE") == 1,
            10,
            f"the removed replicas were not killed: {actors_of_this_job(before)}",
        )
        assert (await proxy.inference(7))[0] == 14


async def test_lost_replicas_are_replaced_where_there_is_room(cluster: RayCluster) -> None:
    """After the second node is lost the head has room for the replacement: the pool
    gets back to its replica count, and both replicas serve."""
    head, second = cluster.head.node_id, cluster.second.node_id
    # 2 of each node's 4 CPUs taken: the two replicas of 2 CPUs take one node each
    head_blocker, _ = [await occupy(node, cpus=2) for node in (cluster.head, cluster.second)]
    before = set(actors_of_this_job())
    async with (
        RayActors(tagged, 2, num_cpus=2, retry_on_crash=True) as actors,
        serving(actors, batch_size=4) as proxy,
    ):
        await asyncio.wait_for(actors.start(), 60)
        placed = sorted(node for _, node in actors_of_this_job(before).values())
        assert placed == sorted([head, second]), "one replica per node to begin with"

        ray.kill(head_blocker)  # room on the head for one more replica
        cluster.kill_node(cluster.second)
        loop = asyncio.get_running_loop()
        lost_at = loop.time()
        while True:
            results = await asyncio.wait_for(
                asyncio.gather(*(proxy.inference(i) for i in range(40))), AFTER_LOSS
            )
            assert [doubled for doubled, _, _ in results] == [2 * i for i in range(40)]
            pids = {pid for _, node, pid in results if node == head}
            if actors.stats.ready == actors.num_replicas == 2 and len(pids) == 2:
                break
            assert loop.time() - lost_at < AFTER_LOSS, f"not replaced: {actors!r}"
            await asyncio.sleep(0.1)
        alive = [node for state, node in actors_of_this_job(before).values() if state == "ALIVE"]
        assert alive == [head, head]
        assert actors.stats.lost == 1
        assert actors.stats.nodes == {head: 2}


@pytest.mark.parametrize("max_concurrent", [2, 4], ids=["max2", "max4"])
@pytest.mark.parametrize("retry", [False, True], ids=["no-retry", "retry"])
async def test_a_node_lost_under_load_fails_exactly_the_batches_it_held(
    cluster: RayCluster, tmp_path: Path, retry: bool, max_concurrent: int
) -> None:
    """Two replicas of 3 CPUs, one per node; once the second node is lost the head has
    no room for a replacement, which stays pending for good. The batches that node
    held fail with `WorkerDied` (or, with `retry_on_crash`, run again on the head);
    every other caller gets its result. The load goes on throughout, so the head is
    busy when the pool routes the retries and the next batches: none may wait on the
    replacement that cannot start."""
    head, second = cluster.head.node_id, cluster.second.node_id
    factory = functools.partial(holding, str(tmp_path), second)
    outcomes: dict[int, Result | WorkerDied] = {}
    items = itertools.count()
    stop = asyncio.Event()

    async def caller(proxy: Proxy[int, Result]) -> None:
        while not stop.is_set():
            item = next(items)
            try:
                outcomes[item] = await proxy.inference(item)
            except WorkerDied as error:
                outcomes[item] = error

    async with (
        RayActors(factory, 2, num_cpus=3, retry_on_crash=retry) as actors,
        serving(actors, batch_size=4, max_concurrent_batches=max_concurrent) as proxy,
    ):
        await asyncio.wait_for(actors.start(), 60)
        callers = [asyncio.ensure_future(caller(proxy)) for _ in range(24)]  # 6 batches' worth
        try:
            await poll(  # (two of its batches ended: `batches`' ended ids are every node's)
                lambda: len(ended_on(tmp_path, second)) >= 2, 30, "the second node ran nothing"
            )
            (tmp_path / "hold").touch()
            await holding_steadily(tmp_path, second)
            cluster.kill_node(cluster.second)
            lost_at = time.time()
            held = running(tmp_path, second)  # what it held when it was lost
            held_items = sorted(item for batch in held.values() for item in batch)
            await poll(
                lambda: (
                    all(item in outcomes for item in held_items)
                    and started_after(tmp_path, lost_at) >= 20
                ),
                AFTER_LOSS,
                f"the held batches were not settled, or the pool did not serve on after the "
                f"loss, within {AFTER_LOSS} s: {actors!r}",
            )
        finally:
            stop.set()  # each caller ends after its call in flight
            _, waiting = await asyncio.wait(callers, timeout=10)
            for call in callers:
                call.cancel()
        assert not waiting, f"{len(waiting)} callers still waiting: {actors!r}"
        for call in callers:
            call.result()  # no other error

    failed = sorted(item for item, outcome in outcomes.items() if isinstance(outcome, WorkerDied))
    answers = {item: o for item, o in outcomes.items() if not isinstance(o, WorkerDied)}
    assert held_items, "the second node held no batch when it was lost"
    assert all(doubled == 2 * item for item, (doubled, _, _) in answers.items())
    if retry:
        assert not failed
        assert {answers[item][1] for item in held_items} == {head}  # run again there
    else:
        assert failed == held_items
    ran_there, _ = batches(tmp_path, second)
    assert len(ran_there) > len(held), "the second node served batches before it was lost"
