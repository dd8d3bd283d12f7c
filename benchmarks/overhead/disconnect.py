"""What cancelling on disconnect costs a request: the FastAPI and aiohttp helpers with
`cancel_on_disconnect=True` (the default) against `False`, on real servers.

Run: `python -m benchmarks.overhead.disconnect` (`--quick` for a smoke run). For each
framework two servers run side by side in child processes on 127.0.0.1, one with
the watch on and one with it off (uvicorn with its default loop and HTTP parser
for FastAPI; aiohttp's own). The model is the identity (`Proxy`, `batch_size=32`),
so what is measured is the HTTP path. Rounds alternate on and off:

1. latency at 1 client: sequential POSTs on one keep-alive connection, the median
   of each round's median;
2. throughput at 32 clients: 32 keep-alive connections posting back to back for a
   fixed time, requests per second, the median over rounds; and the server
   process's CPU time per request meanwhile (from /proc), which the client's
   share of the 2 cores does not blur.

The client is raw asyncio sockets in this process. On a small shared machine the
numbers are noisy: compare on and off of the same run only.

`--in-process`: the ASGI watch alone, without a server, which over HTTP drowns in
the noise: a route that reads its body and sends its response, called as the server
would (one task per request, a `receive` and a `send` that return at once), bare
and through `CancelOnDisconnect`, in interleaved rounds on asyncio's loop and on
uvloop; the CPU time per request (`time.process_time`), the median over rounds.
Every request is answered at once, so no waiter starts: what is measured is what
a fast request pays.
"""

import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._harness.report import (
    Run,
    arguments,
    environment,
    headline,
    no_targets,
    write_report,
)

FULL = {"rounds": 5, "latency_requests": 400, "clients": 32, "seconds": 2.0}
QUICK = {"rounds": 2, "latency_requests": 100, "clients": 32, "seconds": 0.5}
IN_PROCESS_FULL = {"rounds": 20, "requests": 4000}
IN_PROCESS_QUICK = {"rounds": 4, "requests": 500}
BODY = json.dumps({"x": "hello"}).encode()
REQUEST = (
    b"POST /run HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(kind: str, port: int, cancel_on_disconnect: bool) -> None:
    """A child process: the app on 127.0.0.1:`port`."""
    import batchproxy

    class Identity(batchproxy.Proxy[Any, Any]):
        async def _inference(self, items: list[Any]) -> list[Any]:
            return items

    proxy = Identity(batch_size=32)
    if kind == "fastapi":
        import uvicorn
        from fastapi import FastAPI, Request

        from batchproxy.integrations.fastapi import Serving, install

        serving = Serving(proxy)
        app = FastAPI(lifespan=serving.lifespan)
        install(app, serving, cancel_on_disconnect=cancel_on_disconnect)

        async def run(request: Request) -> dict[str, Any]:
            return {"out": await proxy.inference((await request.json())["x"])}

        app.add_api_route("/run", run, methods=["POST"])
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    else:
        from aiohttp import web

        from batchproxy.integrations import aiohttp as helpers

        serving = helpers.Serving(proxy)
        application = web.Application()
        helpers.install(application, serving, cancel_on_disconnect=cancel_on_disconnect)

        async def handle(request: web.Request) -> web.Response:
            item = (await request.json())["x"]
            return web.json_response({"out": await proxy.inference(item)})

        application.router.add_post("/run", handle)
        web.run_app(application, host="127.0.0.1", port=port, access_log=None, print=None)


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(REQUEST)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:40]
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    for _ in range(200):
        try:
            return await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"no server on port {port}")


async def latency(port: int, requests: int) -> float:
    """Median seconds of one request at 1 client."""
    reader, writer = await _connect(port)
    for _ in range(20):  # warm up
        await _post(reader, writer)
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        await _post(reader, writer)
        times.append(time.perf_counter() - start)
    writer.close()
    return statistics.median(times)


def _cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has used (user + system, from /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput(port: int, clients: int, seconds: float) -> tuple[float, int]:
    """Requests per second, `clients` keep-alive connections back to back; and how
    many requests that was."""
    connections = [await _connect(port) for _ in range(clients)]
    done = 0
    end = time.perf_counter() + seconds

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal done
        while time.perf_counter() < end:
            await _post(reader, writer)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(*c) for c in connections))
    elapsed = time.perf_counter() - start
    for _, writer in connections:
        writer.close()
    return done / elapsed, done


async def measure(
    kind: str, ports: dict[bool, int], pids: dict[bool, int], config: dict[str, Any]
) -> dict[str, Any]:
    lat: dict[bool, list[float]] = {True: [], False: []}
    thr: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(config["rounds"]):
        order = (True, False) if round_ % 2 == 0 else (False, True)
        for on in order:
            lat[on].append(await latency(ports[on], config["latency_requests"]))
        for on in order:
            used = _cpu_seconds(pids[on])
            rate, done = await throughput(ports[on], config["clients"], config["seconds"])
            thr[on].append(rate)
            cpu[on].append((_cpu_seconds(pids[on]) - used) / done * 1e6)
    on_us, off_us = (statistics.median(lat[on]) * 1e6 for on in (True, False))
    on_rps, off_rps = (statistics.median(thr[on]) for on in (True, False))
    on_cpu, off_cpu = (statistics.median(cpu[on]) for on in (True, False))
    return {
        "latency_1_client_us": {"on": round(on_us, 1), "off": round(off_us, 1)},
        "added_latency_us": round(on_us - off_us, 1),
        "throughput_32_clients_rps": {"on": round(on_rps), "off": round(off_rps)},
        "throughput_change": round(on_rps / off_rps - 1, 4),
        "server_cpu_us_per_request_32_clients": {"on": round(on_cpu, 1), "off": round(off_cpu, 1)},
        "added_server_cpu_us": round(on_cpu - off_cpu, 1),
    }


async def _in_process(config: dict[str, Any]) -> dict[str, Any]:
    """CPU µs per request, bare and through the watch, on the running loop."""
    from batchproxy.integrations._disconnect import CancelOnDisconnect

    body = {"type": "http.request", "body": BODY, "more_body": False}
    start = {"type": "http.response.start", "status": 200, "headers": []}
    end = {"type": "http.response.body", "body": b"{}", "more_body": False}
    scope = {"type": "http"}

    async def receive() -> dict[str, Any]:
        return body

    async def send(message: Any) -> None:
        pass

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send(start)
        await send(end)

    apps = {False: app, True: CancelOnDisconnect(app)}
    loop = asyncio.get_running_loop()

    async def rounds(on: bool, requests: int) -> float:
        handler = apps[on]
        used = time.process_time()
        for _ in range(requests):
            await loop.create_task(handler(scope, receive, send))
        return (time.process_time() - used) / requests * 1e6

    cpu: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False):  # warm up
        await rounds(on, config["requests"] // 4)
    for round_ in range(config["rounds"]):
        for on in (True, False) if round_ % 2 == 0 else (False, True):
            cpu[on].append(await rounds(on, config["requests"]))
    on_us, off_us = (statistics.median(cpu[on]) for on in (True, False))
    return {
        "cpu_us_per_request": {"on": round(on_us, 2), "off": round(off_us, 2)},
        "added_cpu_us": round(on_us - off_us, 2),
    }


def in_process(cli: Run, env: dict[str, Any]) -> None:
    config = IN_PROCESS_QUICK if cli.quick else IN_PROCESS_FULL
    results: dict[str, Any] = {"asyncio": asyncio.run(_in_process(config))}
    try:
        import uvloop
    except ImportError:
        print("uvloop is not installed: asyncio's loop only")
    else:
        results["uvloop"] = uvloop.run(_in_process(config))
    for loop, row in results.items():
        cpu = row["cpu_us_per_request"]
        print(f"{loop}: {cpu['off']} -> {cpu['on']} us of CPU per request (+{row['added_cpu_us']})")
    _report(cli, env, config, results)


def _report(cli: Run, env: dict[str, Any], config: Any, results: dict[str, Any]) -> None:
    """Either mode's JSON: a cost to report, no pass mark."""
    write_report(
        cli.output,
        env,
        quick=cli.quick,
        config=config,
        targets=no_targets("a cost to report next to the feature, not a pass mark"),
        results=results,
    )


def main(argv: Sequence[str] | None = None) -> None:
    cli = arguments(
        "disconnect", __doc__, argv, mode=("in-process", "the ASGI watch alone, no server")
    )
    env = environment()
    print(headline("disconnect", env, quick=cli.quick))
    if cli.mode:
        in_process(cli, env)
        return
    config = QUICK if cli.quick else FULL
    results: dict[str, Any] = {}
    context = multiprocessing.get_context("spawn")
    for kind in ("fastapi", "aiohttp"):
        ports = {on: _free_port() for on in (True, False)}
        servers = [
            context.Process(target=serve, args=(kind, ports[on], on), daemon=True)
            for on in (True, False)
        ]
        for process in servers:
            process.start()
        try:
            pids = {on: process.pid for on, process in zip((True, False), servers, strict=True)}
            results[kind] = asyncio.run(measure(kind, ports, pids, config))
        finally:
            for process in servers:
                process.terminate()
                process.join(10)
        row = results[kind]
        print(
            f"{kind}: 1 client {row['latency_1_client_us']['off']} -> "
            f"{row['latency_1_client_us']['on']} us (+{row['added_latency_us']} us); "
            f"32 clients {row['throughput_32_clients_rps']['off']} -> "
            f"{row['throughput_32_clients_rps']['on']} req/s "
            f"({row['throughput_change']:+.1%}); server CPU per request at 32 clients "
            f"{row['server_cpu_us_per_request_32_clients']['off']} -> "
            f"{row['server_cpu_us_per_request_32_clients']['on']} us "
            f"(+{row['added_server_cpu_us']} us)"
        )
    _report(cli, env, config, results)


if __name__ == "__main__":
    main(sys.argv[1:])
