"""`benchmarks.servers.run` without building anything: its command line, its summary
and targets on made-up rounds, and the HTTP floor served and stopped as the driver does.
(No peer's environment is built and no model's weights are loaded here.) And the
GPU-shaped model of `--model gpu-sim` (`_gpu_sim.py`): its vectors through the paths the
stacks take (`_common`), and the time of a batch."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

for _module in ("fastapi", "uvicorn", "httpx", "aiohttp", "torch", "transformers"):
    pytest.importorskip(_module)

import httpx  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (the benchmarks package)


@pytest.fixture(scope="module")
def run() -> ModuleType:
    return importlib.import_module("benchmarks.servers.run")


@pytest.fixture(scope="module")
def summary() -> ModuleType:
    return importlib.import_module("benchmarks.servers._summary")


@pytest.fixture(scope="module")
def measure() -> ModuleType:
    return importlib.import_module("benchmarks.servers._measure")


def test_quick_is_levels_1_and_8_one_round(run: ModuleType, tmp_path: Path) -> None:
    parsed = run.arguments("servers", None, ["--quick"], extra=run.extra_flags)
    plan = run.plan_of(parsed)
    assert (plan.levels, plan.rounds) == ((1, 8), 1)
    assert parsed.output.name == "servers-quick.json"
    assert run.stacks_of(parsed) == list(run.DEFAULT["minilm"])
    assert "host" in run.ALL  # (run when named: on 2 cores it only adds processes)
    assert "host" not in run.DEFAULT["minilm"]
    assert run.parse_stacks("host,batchproxy") == ["host", "batchproxy"]
    full = run.plan_of(run.arguments("servers", None, ["--levels", "1,150"], extra=run.extra_flags))
    assert (full.levels, full.rounds) == ((1, 150), run.ROUNDS)
    assert all(5 <= len(text.split()) <= 60 for text in full.texts)
    with pytest.raises(SystemExit):
        run.parse_stacks("batchproxy,nginx")


def test_rows_are_medians_and_fractions_and_the_targets_read_them(
    run: ModuleType, summary: ModuleType
) -> None:
    def rounds(*throughputs: float) -> list[dict[str, object]]:
        return [
            {
                "levels": {1: {"throughput": t, "p50_ms": 10.0, "p99_ms": 20.0, "errors": 0}},
                "check": {"ok": True},
            }
            for t in throughputs
        ]

    measured = {
        "floor": rounds(400.0, 500.0, 600.0),
        "batchproxy": rounds(45.0, 50.0, 60.0),
        "regular": rounds(50.0, 50.0, 50.0),
    }
    rows = run.summarize(measured, [90.0, 100.0, 110.0], (1,))
    mine = summary.row(rows, "batchproxy", 1)
    assert mine["throughput"] == {"median": 50.0, "min": 45.0, "max": 60.0, "rounds": [45, 50, 60]}
    assert mine["of_ceiling"] == pytest.approx(0.5)
    assert mine["of_floor"] == pytest.approx(0.1)
    verdicts = run.verdicts(rows, 100.0)
    assert [v["met"] for v in verdicts if v["clients"] == 1] == [True, True]
    assert all(v["met"] is None for v in verdicts if v["clients"] != 1)  # not measured
    assert "| HTTP floor (no model) | 1 | 500.0 (400.0-600.0) |" in run.table(rows, None)


def test_the_floor_answers_a_vector_and_stops_with_its_group(
    run: ModuleType, measure: ModuleType
) -> None:
    service = measure.StackService(run.STACKS["floor"], Path(sys.executable))
    try:
        service.start()
        answer = httpx.post(f"{service.base_url}/embed", json={"text": "Hello."}, timeout=10)
        assert answer.status_code == 200
        assert len(answer.json()["embedding"]) == 384
    finally:
        service.stop()
    assert service.process is not None
    assert service.process.poll() is not None


def test_a_stack_is_ready_once_every_answer_for_a_while_was_200(
    run: ModuleType, measure: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker up while another still loads (503) is not ready: the first 200 is not
    enough, nor a streak that a 503 or a refused connection breaks."""
    statuses: list[int | None] = []
    clock = [0.0]  # each request takes 10 ms of it

    def post(url: str, **kwargs: object) -> httpx.Response:
        clock[0] += 0.01
        status = statuses.pop(0) if statuses else 200
        if status is None:
            raise httpx.ConnectError("refused")
        return httpx.Response(status)

    monkeypatch.setattr(measure.httpx, "post", post)
    monkeypatch.setattr(measure, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    service = measure.StackService(run.STACKS["floor2"], Path(sys.executable))
    service.base_url = "http://127.0.0.1:1"
    service.ready_for = 0.055  # 6 requests
    statuses[:] = [200, 200, 503]
    assert not service.is_ready()
    statuses[:] = [200, None]
    assert not service.is_ready()
    statuses[:] = [503]
    assert not service.is_ready()
    before = clock[0]
    assert service.is_ready()  # 200s only, for ready_for
    assert statuses == []
    assert clock[0] - before == pytest.approx(0.06)


def test_gpu_sim_is_a_model_with_its_own_results_and_every_stack(run: ModuleType) -> None:
    parsed = run.parse(["--quick", "--model", "gpu-sim"])
    assert parsed.output.name == "servers-gpu-sim-quick.json"
    assert run.parse(["--model", "gpu-sim"]).output.name == "servers-gpu-sim.json"
    assert run.parse(["--model", "gpu-sim", "--output", "x.json"]).output.name == "x.json"
    assert run.plan_of(parsed).model == "gpu-sim"
    assert run.stacks_of(parsed) == list(run.ALL)  # the host and the floor at 2 workers too
    minilm = run.parse([])
    assert run.plan_of(minilm).model == "minilm"
    assert minilm.output.name == "servers.json"
    assert "floor2" not in run.stacks_of(minilm)
    with pytest.raises(SystemExit):
        run.parse(["--model", "bert"])


def test_a_stack_reads_against_the_floor_with_as_many_web_workers(
    run: ModuleType, summary: ModuleType
) -> None:
    def rounds(throughput: float) -> list[dict[str, object]]:
        level = {"throughput": throughput, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0}
        return [{"levels": {8: level}, "check": {"ok": True}}]

    measured = {
        "host": rounds(300.0),
        "batchproxy": rounds(300.0),
        "floor2": rounds(600.0),
        "floor": rounds(1000.0),
    }
    rows = run.summarize(measured, [], (8,))
    assert summary.row(rows, "host", 8)["of_floor"] == pytest.approx(0.5)  # of floor2's
    assert summary.row(rows, "batchproxy", 8)["of_floor"] == pytest.approx(0.3)  # of floor's
    without = run.summarize({"host": rounds(300.0), "floor": rounds(1000.0)}, [], (8,))
    assert summary.row(without, "host", 8)["of_floor"] == pytest.approx(0.3)  # no floor2: floor


def test_the_floor_at_two_workers_answers_and_stops_with_its_group(
    run: ModuleType, measure: ModuleType
) -> None:
    service = measure.StackService(run.STACKS["floor2"], Path(sys.executable))
    try:
        service.start()
        for _ in range(4):
            answer = httpx.post(f"{service.base_url}/embed", json={"text": "Hi."}, timeout=10)
            assert answer.status_code == 200
            assert len(answer.json()["embedding"]) == 384
    finally:
        service.stop()
    assert service.process is not None
    assert service.process.poll() is not None


@pytest.fixture(scope="module")
def common(run: ModuleType) -> ModuleType:
    """`_common`, as the servers import it (the package put examples/ on the path)."""
    return importlib.import_module("benchmarks.servers._common")


@pytest.fixture(scope="module")
def gpu_sim(run: ModuleType) -> ModuleType:
    return importlib.import_module("benchmarks.servers._gpu_sim")


TEXTS = [
    "Hi.",
    "A sentence of a few more words than the first one has.",
    " ".join(["a long sentence that pads every other row of its batch"] * 12),
    "Short again.",
    "The tokenizer is the real one: MiniLM's, from the model package.",
]


def test_gpu_sim_vectors_are_unit_length_and_the_same_alone_and_in_any_batch(
    common: ModuleType, gpu_sim: ModuleType
) -> None:
    import minilm

    tokenizer = minilm.load_tokenizer()  # the real one: gpu-sim's tokenizing is real work
    model = gpu_sim.GpuSim()
    batched = common.encode_texts(tokenizer, model, TEXTS)
    assert batched.dtype == torch.float32
    assert batched.shape == (len(TEXTS), gpu_sim.DIMENSION)
    alone = [common.reference(tokenizer, model, text) for text in TEXTS]
    for text, row, single in zip(TEXTS, batched, alone, strict=True):
        assert torch.equal(row, single), text  # the same bits, padded or not
    # another batch (other neighbours, other padding) gives each text the same vector
    again = common.encode_texts(tokenizer, model, [TEXTS[3], TEXTS[1], TEXTS[0]])
    assert torch.equal(again, batched[[3, 1, 0]])
    norms = torch.linalg.vector_norm(batched.double(), dim=1)
    assert torch.allclose(norms, torch.ones(len(TEXTS), dtype=torch.float64), atol=1e-6)
    assert len({tuple(row.tolist()) for row in batched}) == len(TEXTS)  # each its own


class FakeClocks:
    """A thread CPU clock and a wall clock that move together while the launch spins
    (each reading of the CPU clock: STEP of both), and a sleep that moves the wall."""

    STEP = 0.0001

    def __init__(self) -> None:
        self.cpu = 10.0
        self.wall = 100.0
        self.slept: list[float] = []

    def cpu_clock(self) -> float:
        self.cpu += self.STEP
        self.wall += self.STEP
        return self.cpu

    def wall_clock(self) -> float:
        return self.wall

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.wall += seconds


@pytest.mark.parametrize("rows", [1, 10, 64])
def test_a_gpu_sim_batch_launches_for_4_ms_of_cpu_then_waits_for_the_device(
    gpu_sim: ModuleType, rows: int
) -> None:
    launch, device_s, per_row = gpu_sim.LAUNCH_S, gpu_sim.DEVICE_S, gpu_sim.DEVICE_PER_ROW_S
    assert (launch, device_s, per_row) == (0.004, 0.001, 0.0003)  # the H200's bert-base
    clocks = FakeClocks()
    model = gpu_sim.GpuSim(
        cpu_clock=clocks.cpu_clock, wall_clock=clocks.wall_clock, sleep=clocks.sleep
    )
    ids = torch.arange(1, rows * 7 + 1).reshape(rows, 7)
    out = model.encode(ids, torch.ones_like(ids))
    assert out.shape == (rows, 384)
    assert clocks.cpu - 10.0 == pytest.approx(launch, abs=3 * FakeClocks.STEP)
    device = device_s + per_row * rows  # from the launch's start
    assert model.batch_seconds(rows) == pytest.approx(device)
    if device > launch:  # the device outlasts the launch: wait for it, without CPU
        assert len(clocks.slept) == 1
        assert clocks.wall - 100.0 == pytest.approx(device)
    else:  # one row: launch-bound, the device was done first
        assert clocks.slept == []
        assert clocks.wall - 100.0 == pytest.approx(launch, abs=3 * FakeClocks.STEP)


def test_on_the_real_clocks_gpu_sim_launches_on_cpu_and_its_device_takes_none(
    gpu_sim: ModuleType,
) -> None:
    model = gpu_sim.GpuSim()
    rows = 200  # the device: 1 + 0.3 * 200 = 61 ms, far more than the launch's 4 ms of CPU
    ids = torch.arange(1, rows * 20 + 1).reshape(rows, 20) % 30000
    cpu, wall = time.thread_time(), time.perf_counter()
    model.encode(ids, torch.ones_like(ids))
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert wall >= model.batch_seconds(rows)
    assert cpu >= gpu_sim.LAUNCH_S
    assert cpu < 0.03  # (generous: a loaded machine; a spinning device would take 61 ms)
