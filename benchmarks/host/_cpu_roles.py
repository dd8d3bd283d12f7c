"""The server processes of `host_cpu.py` (`make bench-host-cpu`), one role each, run as
`python -m benchmarks.host._cpu_roles ROLE ...`:

- `--web LAYOUT PORT`: a uvicorn web process (on uvloop, as uvicorn's default) with its
  own listener on PORT (`SO_REUSEPORT`, made with `IPPROTO_TCP` so that asyncio sets
  `TCP_NODELAY`), serving LAYOUT's app (`create_app`) until its stdin closes;
- `--host PATH`: the model host, `python -m batchproxy.host
  benchmarks.host._cpu_roles:model --socket PATH --freeze-gc`;
- `--caller TARGET N SECONDS`: N closed loops of `inference` with no HTTP, on a
  `RemoteProxy` to the host at TARGET (or, for `local`, on the model in this process);
  prints the calls made and this process's CPU seconds.

The model stands for a device: per batch of n items it sleeps 1 + 0.3·n ms (the GIL
released, no CPU) and answers each item with the same 384-float vector. A handler
"tokenizes" cheaply (a word's length per word, as two int64 arrays: the shape of what
a real tokenizer sends). With `$HOST_CPU_PROFILE` each role runs under cProfile (its
CPU time, the loop's thread), written to that folder when it stops. With
`$HOST_CPU_PACKAGE` (`host_cpu.py --base`), the batchproxy package in that folder is
the one imported.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
from typing import Any

PACKAGE_VARIABLE = "HOST_CPU_PACKAGE"
MODULE = "benchmarks.host._cpu_roles"  # (run as `python -m`; the host imports it by name)
if os.environ.get(PACKAGE_VARIABLE):  # `host_cpu.py --base`: that package is the one measured
    sys.path.insert(0, os.environ[PACKAGE_VARIABLE])

import numpy as np  # noqa: E402
from pydantic import BaseModel  # noqa: E402

import batchproxy  # noqa: E402

DIMENSION = 384
BATCH_SIZE = 64
WINDOW_MS = 5.0
LAUNCH_S, PER_ITEM_S = 0.001, 0.0003  # the device's time per batch: 1 + 0.3·n ms
VECTOR = np.full(DIMENSION, 1.0 / np.sqrt(DIMENSION), dtype=np.float32)
CONSTANT = VECTOR.tolist()
PROFILE_VARIABLE = "HOST_CPU_PROFILE"
SOCKET_VARIABLE = "HOST_CPU_SOCKET"


# --------------------------------------------------------------------- the model, the app


class Device(batchproxy.Proxy[Any, Any]):
    """A model whose compute is elsewhere: 1 + 0.3·n ms per batch, the GIL released."""

    def __init__(self) -> None:
        super().__init__(BATCH_SIZE, max_delay_ms=WINDOW_MS, offload=True, timeout=120.0)

    def _inference(self, items: list[Any]) -> list[Any]:
        time.sleep(LAUNCH_S + PER_ITEM_S * len(items))
        return [VECTOR] * len(items)


def model() -> Device:
    """The model host's factory (`python -m batchproxy.host benchmarks.host._cpu_roles:model`)."""
    return Device()


class EmbedIn(BaseModel):
    text: str


class EmbedOut(BaseModel):
    embedding: list[float]


def tokenize(text: str) -> dict[str, Any]:
    ids = np.array([len(word) for word in text.split()], dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def create_app(layout: str) -> Any:
    from fastapi import Depends, FastAPI

    from batchproxy.host import RemoteProxy
    from batchproxy.integrations.fastapi import Serving, install

    if layout.startswith("floor"):
        app = FastAPI()

        @app.post("/embed")
        async def constant(body: EmbedIn) -> EmbedOut:
            return EmbedOut(embedding=CONSTANT)

        return app
    proxy: Any = Device() if layout == "one" else RemoteProxy(os.environ[SOCKET_VARIABLE])
    serving = Serving(proxy)
    app = FastAPI(lifespan=serving.lifespan)
    install(app, serving)
    kind = type(proxy)

    @app.post("/embed")
    async def embed(body: EmbedIn, served: Any = Depends(serving.provider(kind))) -> EmbedOut:  # noqa: B008
        vector = await served.inference(tokenize(body.text))
        return EmbedOut(embedding=vector.tolist())

    return app


def serve_web(layout: str, port: int) -> None:
    """A web process: its own listener on `port` (`SO_REUSEPORT`, `IPPROTO_TCP`), until
    SIGTERM or stdin's end (under cProfile with `$HOST_CPU_PROFILE`)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    config = uvicorn.Config(create_app(layout), log_level="warning", access_log=False,
                            timeout_keep_alive=300, backlog=4096)  # fmt: skip
    server = uvicorn.Server(config)

    def stop_when_the_parent_goes() -> None:
        sys.stdin.read()
        server.should_exit = True

    threading.Thread(target=stop_when_the_parent_goes, daemon=True).start()
    profiled(f"{layout}-web", lambda: server.run(sockets=[sock]))  # (uvloop, if installed)


def serve_host(path: str) -> None:
    from batchproxy.host.__main__ import main

    profiled("host-host", lambda: main([f"{MODULE}:model", "--socket", path, "--freeze-gc"]))


def profiled(name: str, run: Any) -> None:
    folder = os.environ.get(PROFILE_VARIABLE)
    if not folder:
        run()
        return
    import cProfile

    profile = cProfile.Profile(time.thread_time)  # CPU, not wall: the machine is loaded
    profile.enable()
    try:
        run()
    finally:
        profile.disable()
        profile.dump_stats(os.path.join(folder, f"{name}-{os.getpid()}.prof"))


def caller_main(target: str, callers: int, seconds: float) -> None:
    """A client process with no HTTP: `callers` closed loops of `inference` on a
    `RemoteProxy` to the host at `target` (or on a `Device` in this process, for
    `local`); prints its calls and its CPU seconds (the in-process model's included)."""

    async def run() -> tuple[int, float]:
        proxy: Any = Device() if target == "local" else RemoteProxy(target)
        items = [tokenize(text) for text in make_sentences(200, seed=0)]
        calls = 0
        async with proxy:
            for _ in range(3):  # (warm-up)
                await proxy.inference(items[0])
            stop_at = time.monotonic() + seconds
            began = time.process_time()

            async def caller(number: int) -> None:
                nonlocal calls
                while time.monotonic() < stop_at:
                    await proxy.inference(items[(number + calls) % len(items)])
                    calls += 1

            await asyncio.gather(*(caller(n) for n in range(callers)))
            return calls, time.process_time() - began

    import uvloop  # (as a web worker under uvicorn runs)
    from sample_text import make_sentences

    from batchproxy.host import RemoteProxy

    calls, cpu = uvloop.run(run())
    print(json.dumps({"calls": calls, "cpu_s": cpu}), flush=True)


def main() -> None:
    role, *args = sys.argv[1:]
    if role == "--web":
        serve_web(args[0], int(args[1]))
    elif role == "--host":
        serve_host(args[0])
    elif role == "--caller":
        caller_main(args[0], int(args[1]), float(args[2]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
