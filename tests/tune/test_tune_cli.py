"""`python -m batchproxy.tune`: end to end on a toy model in a temporary folder, and the
errors a user meets (a factory that is not there, an empty sample, a target no setting
meets) said in a line, with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _support import nothing_frozen

from batchproxy.tune.__main__ import main, parse_duration

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
QUICK = [
    "--repeats",
    "3",
    "--warmup",
    "1",
    "--sizes",
    "1,4,16",
    "--delays",
    "5",
    "--requests",
    "300",
]


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The CLI run from a temporary folder, the toy models importable as `_toy`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(HERE))
    (tmp_path / "sample.txt").write_text("".join(f"item {i}\n" for i in range(40)))
    return tmp_path


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_the_command_line_measures_recommends_and_writes_the_report(tmp_path: Path) -> None:
    """A real `python -m batchproxy.tune`, in a fresh process, from the toy's folder."""
    (tmp_path / "sample.txt").write_text("".join(f"{i}\n" for i in range(50)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchproxy.tune",
            "_toy:sleeping",
            "--sample",
            "sample.txt",
            "--p99",
            "200ms",
            "--out",
            "report",
            *QUICK,
        ],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "for p99 ≤ 200 ms: batch_size=" in done.stdout
    assert "serves up to" in done.stdout
    assert "another replica" in done.stdout
    # what to expect: typical runs, and how long each is
    assert "the median of 10 simulated runs of 300 calls each, from an idle start" in done.stdout
    assert "measuring [" in done.stderr
    assert "simulating [" in done.stderr
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Recommendation" in report
    assert "| arrivals | throughput (calls/s) | p50 (ms) | p99 (ms) | p99 range (ms) |" in report
    assert "## The cost curve" in report
    code = (tmp_path / "report" / "options.py").read_text()
    namespace: dict[str, object] = {}
    exec(code, namespace)
    tuned = namespace["TUNED"]
    assert isinstance(tuned, dict)
    assert set(tuned) == {"batch_size", "max_concurrent_batches", "max_delay_ms", "window"}
    assert tuned["batch_size"] in (4, 16)


def test_the_report_has_plots_when_matplotlib_is_installed(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    main(["_toy:loading", "--sample", "sample.txt", "--out", "out", *QUICK])
    out = capsys.readouterr().out
    assert "for the most throughput: batch_size=16" in out
    assert (in_tmp / "out" / "cost.png").stat().st_size > 0
    assert (in_tmp / "out" / "latency.png").stat().st_size > 0
    assert "![latency.png](latency.png)" in (in_tmp / "out" / "report.md").read_text()


def test_no_plots_and_a_sample_callable_given_the_proxy(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["_toy:sleeping", "--sample", "_toy:numbers", "--out", "out", "--no-plots", *QUICK])
    assert "for the most throughput" in capsys.readouterr().out
    assert not (in_tmp / "out" / "cost.png").exists()
    assert "No plots" in (in_tmp / "out" / "report.md").read_text()


@pytest.mark.parametrize("freeze", [True, False])
def test_it_measures_with_the_heap_frozen_as_a_service_runs_then_unfreezes(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], freeze: bool
) -> None:
    """A full collection over an unfrozen heap with torch loaded takes 100-200 ms, a slow
    batch in the measurement that a service (which freezes by default) never has."""
    import gc

    import _toy

    _toy.FREEZE_COUNTS.clear()
    before = gc.get_freeze_count()  # (0, or CPython 3.12's own: see `nothing_frozen`)
    flag = [] if freeze else ["--no-freeze-gc"]
    main(["_toy:freeze_counting", "--sample", "sample.txt", "--out", "out", *QUICK, *flag])
    assert _toy.FREEZE_COUNTS
    if freeze:
        # what loading left alive: the interpreter's
        assert min(_toy.FREEZE_COUNTS) > before + 1_000
    else:
        assert max(_toy.FREEZE_COUNTS) < before + 1_000
    assert nothing_frozen()  # thawed, or never frozen
    capsys.readouterr()


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (
            "no_such_module_here:factory",
            "cannot load the factory no_such_module_here:factory: No module",
        ),
        (
            "_toy:no_such_factory",
            "cannot load the factory _toy:no_such_factory: module '_toy' has no",
        ),
        ("_toy", "expected module:factory"),
        ("_toy:FIXED", "is not callable"),
        ("_toy:not_a_proxy", "returned str, not a Proxy, TensorProxy or @batch function"),
    ],
)
def test_a_factory_that_is_not_there_is_said(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], factory: str, message: str
) -> None:
    assert message in _fails([factory, "--sample", "sample.txt", *QUICK], capsys)


def test_an_empty_sample_is_said(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (in_tmp / "empty.txt").write_text("\n  \n")
    assert "'empty.txt' is empty" in _fails(["_toy:sleeping", "--sample", "empty.txt"], capsys)
    assert "'_toy:nothing' is empty" in _fails(
        ["_toy:sleeping", "--sample", "_toy:nothing", *QUICK], capsys
    )
    assert "no such file" in _fails(["_toy:sleeping", "--sample", "missing.txt"], capsys)


def test_an_impossible_target_is_said(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The toy's lone batch takes 4.5 ms: no setting answers 99 % of calls within 1 ms."""
    err = _fails(["_toy:sleeping", "--sample", "sample.txt", "--p99", "1ms", *QUICK], capsys)
    assert "no setting serves even the lightest load" in err
    assert "within 1 ms" in err
    assert not (in_tmp / "tune-report").exists()


def test_a_model_that_fails_on_the_sample_is_said(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _fails(["_toy:failing", "--sample", "sample.txt", *QUICK], capsys)
    assert "the model failed on a batch of 1 sample items: ValueError: this model cannot" in err


def test_bad_options_are_said(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--p99 'fast'" in _fails(
        ["_toy:sleeping", "--sample", "sample.txt", "--p99", "fast"], capsys
    )
    assert "--windows" in _fails(
        ["_toy:sleeping", "--sample", "sample.txt", "--windows", "slow"], capsys
    )
    assert "numbers > 0" in _fails(
        ["_toy:sleeping", "--sample", "sample.txt", "--sizes", "0,4"], capsys
    )
    assert "--paths 0: at least 1 run" in _fails(
        ["_toy:sleeping", "--sample", "sample.txt", "--paths", "0"], capsys
    )


def test_durations() -> None:
    assert parse_duration("50ms") == pytest.approx(0.05)
    assert parse_duration("0.2s") == pytest.approx(0.2)
    assert parse_duration("800us") == pytest.approx(0.0008)
    assert parse_duration("50") == pytest.approx(0.05)
