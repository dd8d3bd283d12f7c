"""The options are held once, by the proxy's intake: `configure` replaces them there,
and the runner, the proxy and the call forms read them there."""

from __future__ import annotations

import pytest
from _support import Recorder

import batchproxy


def test_the_intake_holds_the_options_and_the_others_read_them_there() -> None:
    proxy = Recorder(batch_size=8, timeout=5.0)
    before = proxy.options
    assert proxy._runner.options is before
    assert proxy._intake.options is before
    proxy.configure(batch_size=4, max_delay_ms=1)
    new = proxy.options
    assert new.batch_size == 4
    assert proxy._runner.options is new
    assert proxy._intake.options is new
    assert proxy._options is new


def test_no_other_object_keeps_a_copy_of_its_own() -> None:
    proxy = Recorder(batch_size=8)
    assert "options" not in vars(proxy._runner)
    assert "_options" not in vars(proxy)
    assert "options" in vars(proxy._intake)


async def test_a_configured_value_reaches_the_runs_and_the_calls() -> None:
    async with Recorder(batch_size=8, max_delay_ms=0) as proxy:
        proxy.configure(batch_size=2)
        assert await proxy.inference_many(list(range(5))) == [("out", i) for i in range(5)]
        assert max(len(batch) for batch in proxy.batches) == 2
        proxy.configure(timeout=0.5)
        assert proxy._runner.options.timeout == 0.5 == proxy.options.timeout


def test_a_bad_change_leaves_the_one_copy_as_it_was() -> None:
    proxy = Recorder(batch_size=8)
    before = proxy.options
    with pytest.raises(ValueError):
        proxy.configure(batch_size=0)
    assert proxy.options is before is proxy._runner.options
    assert isinstance(before, batchproxy.Options)
