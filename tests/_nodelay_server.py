"""A FastAPI app set up as docs/serving.md shows it (`Serving`, its lifespan, `install`),
for the tests that serve it with `uvicorn --workers N`: each worker reports whether the
connection it answers on has TCP_NODELAY.

    cd tests && uvicorn _nodelay_server:app --workers 2 --loop asyncio --port 0

`GET /nodelay` answers `{"nodelay": 0 or 1, "pid": the worker's}`: the option on this
worker's own socket for the connection the request came on (found by the client's
address, `scope["client"]`, among the process's sockets). `GET /echo/{n}` answers
`{"n": n}` through a proxy, as a route of the service would.
"""

from __future__ import annotations

import os
import socket
import stat
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from typing_extensions import override

import batchproxy
from batchproxy.integrations.fastapi import Serving, install


class Echo(batchproxy.Proxy[int, int]):
    @override
    async def _inference(self, items: list[int]) -> list[int]:
        return items


def accepted_nodelay(client: tuple[str, int]) -> int:
    """TCP_NODELAY on this process's socket whose peer is `client`."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))  # (a TCP or Unix socket here)
        except OSError:
            continue  # closed meanwhile
        with sock:
            try:
                if sock.getpeername()[:2] == tuple(client):
                    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            except OSError:
                continue  # not connected
    raise HTTPException(500, f"no socket of this process has the peer {client}")


serving = Serving(Echo(batch_size=8, name="echo"))
app = FastAPI(lifespan=serving.lifespan)
install(app, serving)


@app.get("/nodelay")
async def nodelay(request: Request) -> dict[str, Any]:
    assert request.client is not None
    return {"nodelay": accepted_nodelay((request.client.host, request.client.port)),
            "pid": os.getpid()}  # fmt: skip


@app.get("/echo/{n}")
async def echo(n: int, proxy: Annotated[Echo, Depends(serving.provider(Echo))]) -> dict[str, int]:
    return {"n": await proxy.inference(n)}
