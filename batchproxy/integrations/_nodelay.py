"""TCP_NODELAY on this process's TCP listeners, so that every connection they accept has it.

asyncio's loop sets TCP_NODELAY on each TCP connection it makes, but only when the
socket object says `proto == IPPROTO_TCP`. A listener made as `socket.socket(AF_INET)`
says 0, and so does every connection it accepts: `uvicorn --workers N` (and
`--reload`) binds the listener it shares with its workers that way (uvicorn issue
#3149). On such a connection Nagle's algorithm holds a response's body until the
client acknowledges its headers, and a keep-alive client delays that ACK: about 40 ms
per request on Linux, whatever the app does. uvloop sets the option on every
connection itself, and gunicorn on its listeners; but `uvicorn --fd N` takes the
socket handed down for a Unix one, and then neither loop sets it.

An accepted connection inherits its listener's TCP_NODELAY (Linux and the BSDs), so
setting it on the listener mends every connection, whichever worker accepts it and
whatever loop it runs. `Serving.start()` calls `nodelay_listeners()` in each worker
(its lifespan runs before uvicorn's worker starts to listen, once the shared socket
is bound); `Serving(tcp_nodelay=False)` leaves the sockets as they are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Iterator

__all__ = ["nodelay_listeners"]

logger = logging.getLogger("batchproxy")

_TCP_CLOSE = 7  # `tcpi_state` of a socket that is neither listening nor connected (Linux)


def nodelay_listeners() -> int:
    """Set TCP_NODELAY on each TCP socket of this process that is a listener (listening,
    or bound and neither connected nor connecting: its server has yet to `listen()`)
    and lacks it; return how many were set. Connections are left as they are, and so
    is every socket where the process's descriptors cannot be listed (no /proc/self/fd
    nor /dev/fd). Idempotent."""
    count = 0
    for sock in _sockets():
        with sock, contextlib.suppress(OSError):
            if _is_tcp(sock) and _is_listener(sock) and not _nodelay(sock):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                count += 1
    if count:
        logger.debug("TCP_NODELAY set on %d listening socket(s) of this process", count)
    return count


def _sockets() -> Iterator[socket.socket]:
    """A duplicate of each socket descriptor of this process (closing one leaves the
    process's own open)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            fds = [int(name) for name in os.listdir(folder) if name.isdigit()]
        except OSError:
            continue
        break
    else:
        return
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            duplicate = os.dup(fd)
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, say)
        try:
            sock = socket.socket(fileno=duplicate)
        except OSError:  # a family Python does not know: socket() leaves it open
            os.close(duplicate)
            continue
        yield sock


def _is_tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM


def _is_listener(sock: socket.socket) -> bool:
    accepting = getattr(socket, "SO_ACCEPTCONN", None)
    if accepting is not None and sock.getsockopt(socket.SOL_SOCKET, accepting):
        return True
    if sock.getsockname()[1] == 0:
        return False  # not bound to a port: nothing will accept on it
    try:
        sock.getpeername()
    except OSError:
        pass  # no peer
    else:
        return False  # a connection
    info = getattr(socket, "TCP_INFO", None)  # Linux: tell a connect in flight apart
    return info is None or sock.getsockopt(socket.IPPROTO_TCP, info, 1)[0] == _TCP_CLOSE


def _nodelay(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
