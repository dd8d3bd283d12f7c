"""`Limits`: what a proxy tells its scheduler, a frozen value read by field name, made
from the options, the executor's capacity and the batch cap, and handed on whole when
`configure` changes it."""

from __future__ import annotations

import dataclasses

import pytest
from _support import Recorder, scheduler_of

from batchproxy import WorkerThread
from batchproxy._options import Options
from batchproxy._scheduling.scheduler import Limits


def test_limits_are_a_frozen_value_with_named_fields() -> None:
    limits = Limits(
        batch_size=8, max_delay=0.002, slots=2, adaptive=False, aging=0.5, predicts=True
    )
    assert [field.name for field in dataclasses.fields(Limits)] == [
        "batch_size",
        "max_delay",
        "slots",
        "adaptive",
        "aging",
        "predicts",
        "bulk_threshold",
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.batch_size = 4  # type: ignore[misc]
    assert dataclasses.replace(limits, slots=3).slots == 3
    assert limits == Limits(8, 0.002, 2, False, 0.5, True)


def test_the_runner_makes_them_from_the_options() -> None:
    proxy = Recorder(batch_size=16, max_delay_ms=3, window="fixed", aging_ms=250)
    assert proxy._runner.limits() == Limits(
        batch_size=16,
        max_delay=0.003,
        slots=1,
        adaptive=False,
        aging=0.25,
        predicts=False,
        bulk_threshold=Options().bulk_threshold,
    )


def test_slots_follow_the_executor_unless_set_and_predict_batch_ends() -> None:
    worker = WorkerThread(overlap=True)  # two batches in flight
    proxy = Recorder(offload=worker)
    assert proxy._runner.limits().slots == 2
    assert proxy._runner.limits().predicts  # several slots to stagger
    proxy.configure(max_concurrent_batches=1)
    assert proxy._runner.limits().slots == 1
    assert not proxy._runner.limits().predicts
    proxy.configure(shed_late=True)
    assert proxy._runner.limits().predicts  # calls to shed
    worker.close()


async def test_configure_hands_the_scheduler_new_limits_by_name() -> None:
    async with Recorder(batch_size=8, max_delay_ms=2) as proxy:
        await proxy.inference("bind")
        scheduler = scheduler_of(proxy)
        told: list[Limits] = []
        reconfigure = scheduler.reconfigure

        def spy(limits: Limits) -> None:
            told.append(limits)
            reconfigure(limits)

        scheduler.reconfigure = spy
        proxy.configure(batch_size=4, max_delay_ms=7)
        assert told == [proxy._runner.limits()]
        assert (told[0].batch_size, told[0].max_delay) == (4, 0.007)
        assert proxy.stats.max_in_flight == told[0].slots
