"""`examples/workers_app.py` as its docstring runs it: a model host (`python -m
batchproxy.host workers_app:embedder`) and `uvicorn workers_app:app --workers 2` in
front of it (on a Unix socket of their own, so no port is taken). Every answer is
the sentence's own embedding, both workers answer, and a host that is gone is
answered 503; then the workers start a host of their own, which serves, and which
exits after them (no process, no socket left)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))


class Stack:
    """The host and the web workers, started here and stopped on the way out."""

    def __init__(self, folder: str) -> None:
        self.model_socket = os.path.join(folder, "model.sock")
        self.web_socket = os.path.join(folder, "web.sock")
        paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
               "MODEL_SOCKET": self.model_socket, "MODEL_HOST_IDLE_EXIT": "1"}  # fmt: skip
        self.host = subprocess.Popen(
            [sys.executable, "-m", "batchproxy.host", "workers_app:embedder",
             "--socket", self.model_socket, "--freeze-gc"],
            cwd=EXAMPLES, env=env, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.host.stderr is not None
        line = self.host.stderr.readline()
        assert "serving" in line, line
        self.web = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "workers_app:app", "--workers", "2",
             "--uds", self.web_socket, "--log-level", "warning"],
            cwd=EXAMPLES, env=env,
        )  # fmt: skip

    def client(self) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(uds=self.web_socket)
        return httpx.AsyncClient(transport=transport, base_url="http://workers", timeout=60)

    def stop(self) -> None:
        for process in (self.web, self.host):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (self.web, self.host):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        # a host the workers started exits on its own once they are gone
        deadline = time.monotonic() + 30
        while self.hosts() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.hosts():  # (it did not: the assertion below says so)
            os.kill(pid, signal.SIGKILL)

    def hosts(self) -> list[int]:
        """The pids of the live host processes on the model socket."""
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().split(") ")[-1][0]
            except (OSError, ValueError):
                continue
            on_socket = self.model_socket.encode() in command and b"batchproxy.host" in command
            if on_socket and state != "Z":  # (a zombie has exited)
                pids.append(int(entry.name))
        return pids


@pytest.fixture
def stack() -> Iterator[Stack]:
    folder = tempfile.mkdtemp(prefix="bp-workers-", dir="/tmp")
    running = Stack(folder)
    try:
        yield running
    finally:
        running.stop()
        left = os.listdir(folder)
        for name in left:
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
        assert "model.sock" not in left  # the hosts removed their socket, and exited


async def _ready(client: httpx.AsyncClient) -> None:
    """Until both workers answer: each is ready (it heard from the host) and serves."""
    deadline = time.monotonic() + 120
    workers: set[int] = set()
    while len(workers) < 2:
        assert time.monotonic() < deadline, f"the workers did not come up ({workers})"
        try:
            answers = await asyncio.gather(  # new connections: either worker may take one
                *(
                    client.post("/embed", json={"text": "hello"}, headers={"Connection": "close"})
                    for _ in range(8)
                )
            )
        except httpx.TransportError:
            answers = []
        workers |= {a.json()["worker"] for a in answers if a.status_code == 200}
        await asyncio.sleep(0.1)


async def test_two_workers_share_one_host_and_every_answer_is_its_own(stack: Stack) -> None:
    from minilm import load_minilm, reference_embedding
    from sample_text import make_sentences

    texts = make_sentences(200, seed=4)
    async with stack.client() as client:
        await _ready(client)
        answers = await asyncio.gather(*(client.post("/embed", json={"text": t}) for t in texts))
        assert [answer.status_code for answer in answers] == [200] * len(texts)
        assert (await client.post("/embed", json={"text": "  "})).status_code == 422
        workers = {answer.json()["worker"] for answer in answers}
        assert len(workers) == 2  # both uvicorn workers answered
        tokenizer, model = load_minilm()
        for text, answer in zip(texts[:40], answers[:40], strict=True):
            got = torch.tensor(answer.json()["embedding"])
            want = reference_embedding(tokenizer, model, text)
            assert torch.allclose(got, want, atol=2e-6), text
        stack.host.send_signal(signal.SIGTERM)  # the host goes: calls get 503, not a hang
        stack.host.wait(timeout=30)
        gone = await client.post("/embed", json={"text": "after the host"})
        assert gone.status_code == 503
        assert gone.json()["error"] == "HostUnavailable"
        assert "Retry-After" in gone.headers
        await _ready(client)  # a worker started a host of its own
        [host] = stack.hosts()
        assert host != stack.host.pid
        again = await client.post("/embed", json={"text": texts[0]})
        assert again.status_code == 200
        before = torch.tensor(answers[0].json()["embedding"])
        assert torch.allclose(torch.tensor(again.json()["embedding"]), before, atol=2e-6)
