"""Messages between the proxy's process and its worker processes, over a local pipe.

A message is pickled with protocol 5 and its large buffers kept out of band:
a NumPy array (and a CPU torch tensor, sent as a NumPy view of its memory)
crosses as its raw bytes, written straight from the array and read straight
into a fresh writable buffer, never copied into or out of the pickle stream.
Frames on the pipe: a header (buffer count and sizes), the pickle, each buffer.

`encode` does all the pickling before anything is written, so an object that
cannot be pickled fails there and leaves the pipe in step. Only the two ends
of a pipe this library created exchange messages: nothing is unpickled from a
socket or from anyone else.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Frames", "Unsent", "decode", "encode", "receive", "send"]

Frames = list[Any]  # bytes-like: header, pickle, buffers
_COUNT = struct.Struct("<Q")


def encode(obj: object) -> Frames:
    """Pickle `obj` into frames (raises what pickling raises; nothing is sent)."""
    buffers: list[pickle.PickleBuffer] = []
    if "torch" in sys.modules:  # only then can a tensor be in there
        stream = io.BytesIO()
        _TensorPickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
        data = stream.getbuffer()
    else:
        data = memoryview(pickle.dumps(obj, protocol=5, buffer_callback=buffers.append))
    views = [buffer.raw() for buffer in buffers]
    header = struct.pack(f"<{len(views) + 1}Q", len(views), *(view.nbytes for view in views))
    return [header, data, *views]


class Unsent(OSError):
    """None of the message was written: the other end was gone before it."""


def send(conn: Connection, frames: Frames) -> None:
    """Write one message's frames. Raises `Unsent` if the first write fails (the
    header is small: written whole or not at all), or the OSError of a later one."""
    try:
        conn.send_bytes(frames[0])
    except OSError as exc:
        raise Unsent(exc.errno, exc.strerror) from exc
    for frame in frames[1:]:
        conn.send_bytes(frame)


def receive(conn: Connection) -> Frames:
    """Read one message's frames (raises EOFError or OSError if the other end is gone)."""
    header = conn.recv_bytes()
    (count,) = _COUNT.unpack_from(header)
    sizes = struct.unpack_from(f"<{count}Q", header, _COUNT.size)
    data = conn.recv_bytes()
    buffers: list[Any] = []
    for size in sizes:
        buffer = bytearray(size)
        if size:
            conn.recv_bytes_into(buffer)
        else:
            conn.recv_bytes()
        buffers.append(buffer)
    return [header, data, *buffers]


def decode(frames: Frames) -> Any:
    return pickle.loads(frames[1], buffers=frames[2:])


class _TensorPickler(pickle.Pickler):
    """Sends a plain, dense CPU torch tensor as a NumPy view of its memory (out of
    band); anything else is pickled as usual."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules["torch"]
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not obj.requires_grad
        ):
            try:
                array = obj.numpy()  # shares memory; unsupported dtypes raise
            except (TypeError, RuntimeError):
                return NotImplemented
            return _tensor_from_numpy, (array,)
        return NotImplemented


def _tensor_from_numpy(array: Any) -> Any:
    import torch

    return torch.from_numpy(array)
