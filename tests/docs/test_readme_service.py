"""The README's first service, exactly as printed: extracted from README.md, written to
a temporary `app.py`, and run with `python -m uvicorn app:app` on 127.0.0.1."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

for _module in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_module)

import httpx  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "<!-- service: app.py -->"
BLOCK = re.compile(re.escape(MARK) + r"\n```python\n(.*?)\n```\n", re.DOTALL)
STARTUP_SECONDS = 30.0


def service_code() -> str:
    match = BLOCK.search(README.read_text(encoding="utf-8"))
    assert match is not None, f"README.md has no ```python block right after {MARK}"
    return match.group(1) + "\n"


def test_the_service_opens_the_readme_and_is_short() -> None:
    readme = README.read_text(encoding="utf-8")
    assert readme.count(MARK) == 1
    first_line = readme[: readme.index(MARK)].count("\n") + 1
    assert first_line <= 30, first_line
    assert len(service_code().splitlines()) <= 42  # about 40


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(params=["asyncio", "uvloop"])
def service(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The README's service under uvicorn in a child process, on asyncio's loop and on
    uvloop (`uvicorn --loop uvloop`, what `uvicorn[standard]` runs by default); its base
    URL once ready. The child is always terminated (killed if it will not stop)."""
    loop = request.param
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    (tmp_path / "app.py").write_text(service_code(), encoding="utf-8")
    port = free_port()
    log_path = tmp_path / "uvicorn.log"
    command = [sys.executable, "-m", "uvicorn", "app:app", "--loop", loop, "--host", "127.0.0.1"]
    command.append("--port")
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [*command, str(port)],
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:  # a child process: nothing to wait on but its readiness route
            assert server.poll() is None, f"uvicorn exited:\n{log_path.read_text()}"
            try:
                if httpx.get(f"{base_url}/readyz", timeout=5.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not ready:\n{log_path.read_text()}"
            time.sleep(0.05)
        yield base_url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


TEXTS = [f"text number {n} of the README test" + " word" * (n % 5) for n in range(48)]


async def test_the_readme_service_batches_maps_errors_and_has_health_routes(
    service: str,
) -> None:
    async with httpx.AsyncClient(
        base_url=service, limits=httpx.Limits(max_connections=None), timeout=10.0
    ) as http:
        answers = await asyncio.gather(*(http.post("/embed", json={"text": t}) for t in TEXTS))
        empty = await http.post("/embed", json={"text": "  "})
        live, ready = await http.get("/livez"), await http.get("/readyz")
        schema = (await http.get("/openapi.json")).json()

    assert [a.status_code for a in answers] == [200] * len(TEXTS)
    for text, answer in zip(TEXTS, answers, strict=True):
        body = answer.json()
        assert body["vector"] == pytest.approx([len(text) / 100, text.count(" ") / len(text)])
        assert 1 <= body["batch_size"] <= 32
    assert max(a.json()["batch_size"] for a in answers) > 1  # requests shared model calls

    assert empty.status_code == 422
    assert empty.json() == {"detail": "text must not be empty", "error": "InvalidItem"}

    assert (live.status_code, live.json()["status"]) == (200, "ready")
    assert (ready.status_code, ready.json()["ready"]) == (200, True)
    assert ready.json()["proxies"] == {"Embedder": {"state": "healthy"}}
    assert set(schema["paths"]) == {"/embed"}  # the probes stay out of the schema
    assert {"EmbedIn", "EmbedOut"} <= set(schema["components"]["schemas"])
