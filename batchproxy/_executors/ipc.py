"""Messages between the proxy's process and its worker processes, over a local pipe.

A message is pickled with protocol 5 and its large buffers kept out of band:
a NumPy array (and a CPU torch tensor, sent as a NumPy view of its memory)
crosses as its raw bytes, written straight from the array and read straight
into a fresh writable buffer, never copied into or out of the pickle stream.
Frames on the pipe: a header (buffer count and sizes), the pickle, each buffer.
A plain C-contiguous array of numbers travels as its dtype's string, its shape
and its buffer (`_array`): what NumPy's own reduction carries, without pickling
the dtype object, which cost most of a small array's pickling.

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
    frames = pickled(obj)
    views = frames[1:]
    header = struct.pack(f"<{len(views) + 1}Q", len(views), *(view.nbytes for view in views))
    return [header, *frames]


def pickled(obj: object) -> Frames:
    """`obj` pickled (protocol 5): the pickle, then each out-of-band buffer, raw (raises
    what pickling raises)."""
    buffers: list[pickle.PickleBuffer] = []
    if "numpy" in sys.modules or "torch" in sys.modules:  # only then can an array be in there
        stream = io.BytesIO()
        _ArrayPickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
        data = stream.getbuffer()
    else:
        data = memoryview(pickle.dumps(obj, protocol=5, buffer_callback=buffers.append))
    return [data, *(buffer.raw() for buffer in buffers)]


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


class _ArrayPickler(pickle.Pickler):
    """Sends a plain NumPy array as its dtype's string, its shape and its buffer (out of
    band), and a plain, dense CPU torch tensor as such an array (a NumPy view of its
    memory); anything else is pickled as usual."""

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        numpy = sys.modules.get("numpy")
        if numpy is not None and kind is numpy.ndarray:
            return _array_reduction(obj)
        torch = sys.modules.get("torch")
        if (
            torch is not None
            and kind is torch.Tensor
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


_PLAIN: dict[Any, str | None] = {}
"""Each dtype met: its string if an array of it travels as `_array` (numbers, no fields,
no metadata: the string rebuilds the same dtype), else None."""


def _array_reduction(array: Any) -> Any:
    dtype = array.dtype
    code = _PLAIN.get(dtype, "")
    if code == "":
        plain = dtype.kind in "biufc" and dtype.fields is None and dtype.metadata is None
        code = _PLAIN[dtype] = dtype.str if plain and dtype.subdtype is None else None
    if code is None or not array.flags.c_contiguous:
        return NotImplemented  # (NumPy's own reduction)
    return _array, (code, array.shape, pickle.PickleBuffer(array))


def _array(code: str, shape: tuple[int, ...], buffer: Any) -> Any:
    import numpy

    return numpy.frombuffer(buffer, dtype=code).reshape(shape)


def _tensor_from_numpy(array: Any) -> Any:
    import torch

    return torch.from_numpy(array)
