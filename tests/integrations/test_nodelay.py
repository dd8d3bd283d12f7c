"""`Serving.start()` sets TCP_NODELAY on the process's TCP listeners, so the connections
they accept have it (the kernel copies it from the listener), and leaves connections,
other sockets and every descriptor it looked at as they were.

The listeners here are made as uvicorn's supervisor makes the one it shares with its
workers: `socket.socket(AF_INET)` (proto 0), bound but not yet listening when a
worker's lifespan starts. Accepted with plain `accept()`, not by an event loop, so
what is checked is the socket's own option, whatever loop the suite runs on
(`tests/integrations/test_nodelay_uvicorn.py` serves them with real workers).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from _support import Recorder, descriptors

from batchproxy.integrations._nodelay import nodelay_listeners
from batchproxy.integrations._serving import Serving


def nodelay(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@contextmanager
def bound() -> Iterator[socket.socket]:
    """A TCP socket as uvicorn's `Config.bind_socket()` makes it: bound, not listening."""
    with socket.socket(socket.AF_INET) as listener:
        assert listener.proto == 0  # what keeps asyncio from setting TCP_NODELAY
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(30)
        yield listener


@contextmanager
def unix_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair()
    with left, right:
        yield left, right


def accepted_nodelay(listener: socket.socket) -> int:
    """TCP_NODELAY on a connection `listener` accepts."""
    with socket.create_connection(listener.getsockname(), timeout=30):
        accepted, _ = listener.accept()
        with accepted:
            return nodelay(accepted)


async def test_a_listener_bound_before_start_hands_every_connection_nodelay() -> None:
    with bound() as listener:
        serving = Serving(Recorder())
        async with serving.running():
            listener.listen()  # as a uvicorn worker does after its lifespan started
            assert nodelay(listener) == 1
            assert [accepted_nodelay(listener) for _ in range(3)] == [1, 1, 1]
            with bound() as later:  # made after start(): left as the kernel makes it
                later.listen()
                assert accepted_nodelay(later) == 0


async def test_a_listening_socket_gets_it_too() -> None:
    with bound() as listener:
        listener.listen()
        async with Serving(Recorder()).running():
            assert accepted_nodelay(listener) == 1


async def test_tcp_nodelay_false_leaves_the_sockets_alone() -> None:
    with bound() as listener:
        serving = Serving(Recorder(), tcp_nodelay=False)
        assert serving.tcp_nodelay is False
        async with serving.running():
            listener.listen()
            assert nodelay(listener) == 0
            assert accepted_nodelay(listener) == 0
    with pytest.raises(TypeError, match="tcp_nodelay must be a bool"):
        Serving(Recorder(), tcp_nodelay=1)  # type: ignore[arg-type]


def test_connections_and_other_sockets_are_left_as_they_are() -> None:
    with bound() as listener, unix_pair() as (left, right):
        listener.listen()
        with socket.create_connection(listener.getsockname(), timeout=30) as client:
            accepted, _ = listener.accept()  # accepted before: Nagle on, as it was made
            with accepted:
                assert nodelay_listeners() >= 1  # this listener (and any other of the process)
                assert (nodelay(client), nodelay(accepted)) == (0, 0)
                assert nodelay(listener) == 1
                assert nodelay_listeners() == 0  # idempotent
                left.sendall(b"x")  # the Unix pair was looked at, and still works
                assert right.recv(1) == b"x"


def test_it_leaves_no_descriptor_behind() -> None:
    """Each descriptor is looked at through a duplicate, closed after: a file, a pipe,
    a Unix socket and a TCP listener, and the count of open descriptors is unchanged."""
    reading, writing = os.pipe()
    try:
        with open(__file__, "rb"), unix_pair(), bound() as listener:
            listener.listen()
            before = descriptors()
            for _ in range(3):
                nodelay_listeners()
            # a duplicate left open names what one of ours names (only those are
            # compared: another library's native thread may open a socket meanwhile,
            # as Ray's GCS client does after the Ray tests)
            left = {fd: target for fd, target in descriptors().items() if fd not in before}
            assert not set(left.values()) & set(before.values()), left
    finally:
        os.close(reading)
        os.close(writing)
