"""The examples run as documented (`make demo`) and report what they claim."""

from __future__ import annotations

import re

import pytest
from _support import load_example, run_script


def test_quickstart_runs_as_a_script() -> None:
    out = run_script("quickstart", timeout=60)
    requests = re.search(r"^requests:\s+(\d+)$", out, re.MULTILINE)
    batches = re.search(r"^model calls:\s+(\d+) batches$", out, re.MULTILINE)
    assert requests is not None, out
    assert batches is not None, out
    assert int(requests.group(1)) == 200
    assert 1 <= int(batches.group(1)) < 200
    assert "batch sizes:" in out
    assert "p99" in out


async def test_quickstart_main(capsys: pytest.CaptureFixture[str]) -> None:
    quickstart = load_example("quickstart")
    stats = await quickstart.main()
    assert stats.requests == stats.succeeded == stats.items == 200
    assert stats.errors == stats.timed_out == stats.cancelled == stats.rejected == 0
    assert stats.batches < 200
    assert max(stats.batch_sizes) <= quickstart.BATCH_SIZE
    assert sum(size * count for size, count in stats.batch_sizes.items()) == 200
    assert "requests:    200" in capsys.readouterr().out
