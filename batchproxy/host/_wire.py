"""The messages between a `RemoteProxy` and its `ModelHost`, on a Unix domain socket.

A message is a tuple, encoded as the worker pipes' frames (`_executors.ipc`: a
header, the pickle (protocol 5), each large buffer out of band, never copied into
the pickle); on the socket it is the frame count, then each frame's length and bytes.

- client to host: `("call", id, item, options)`, `("stream", id, item, options)`,
  `("many", id, [item, ...], options, return_exceptions)` (`inference_many`, each
  item sealed on its own), `("cancel", id)`, and `("health", id)` (answered with a
  `result`: the host's `Health`);
- host to client: `("result", id, value)`, a stream's `("chunk", id, value)`s then
  its `("end", id, None)`, a list's `("results", id, [(kind, value), ...])` (each
  item's `"result"` or `"error"`, sealed on its own), and `("error", id, packed
  exception)` (a call's last answer, as are a result, a list's results and an end).

The item, the value and the packed exception travel sealed (`seal`: pickled on their
own, their buffers still out of band) and are opened (`open_sealed`) by the call they
belong to: one that cannot be unpickled at the other end (a class only one side can
import, a `__reduce__` that raises) fails that call alone, not the connection. A
sealed buffer of `_shm.THRESHOLD` bytes or more travels in shared memory instead
(`_shm`: who makes and who unlinks the segments); the reader maps those as it reads
the message (`read_message`), so its arrays are views of the segment.

`options` holds the call's `priority`, `tenant` and `key` as given, and for a call
with a timeout its `timeout` and its `deadline` on `time.monotonic()` (the system's
monotonic clock, the same in every process of the machine).

Who may send what is unpickled: only processes of the host's own user can open the
socket (mode 0600) and be heard (the host checks `SO_PEERCRED`), as with the pipes to
worker processes this library starts.
"""

from __future__ import annotations

import asyncio
import builtins
import importlib
import pickle
import struct
from typing import Any

from .._executors.ipc import decode, encode
from . import _shm

__all__ = [
    "message_bytes",
    "open_sealed",
    "pack_error",
    "read_message",
    "seal",
    "sealed_message",
    "segment_names",
    "unpack_error",
]

_COUNT = struct.Struct("<I")
_SIZE = struct.Struct("<Q")


def message_bytes(message: tuple[Any, ...]) -> bytes:
    """The bytes to write for `message`: raises what pickling raises, before anything
    is written (so a message that cannot be sent leaves the socket in step).

    Returned as one `bytes`, with no view into the pickled buffers left behind: a
    memoryview of a `PickleBuffer` that outlives this call can end up in a reference
    cycle (an exception's traceback, a frame), and CPython 3.12.1's collector then
    released the buffer under the view (a segfault, seen in this package's tests)."""
    frames = encode(message)
    out = bytearray(_COUNT.pack(len(frames)))
    for frame in frames:
        with memoryview(frame) as view:
            out += _SIZE.pack(view.nbytes)
            out += view
    del frames
    return bytes(out)


def seal(value: Any) -> list[Any]:
    """`value` pickled on its own, to travel inside a message (raises what pickling
    raises, before any segment is made): the pickle and each buffer as a
    `PickleBuffer`, or a buffer of `_shm.THRESHOLD` bytes or more copied into a
    shared-memory segment, as its `_shm.Segment`. The caller owns those segments
    (`segment_names`): it writes them on a connection or unlinks them."""
    frames = encode(value)
    parts: list[Any] = [pickle.PickleBuffer(frames[1])]
    try:
        for view in frames[2:]:
            segment = _shm.put(view) if view.nbytes >= _shm.THRESHOLD else None
            if segment is None:
                parts.append(pickle.PickleBuffer(view))
            else:
                parts.append(segment)
                view.release()  # copied: the array's buffer is let go at once
    except BaseException:  # (put fails with None, not OSError: only an interrupt)
        _shm.unlink(segment_names(parts))
        raise
    return parts


def segment_names(parts: list[Any]) -> list[str]:
    """The shared-memory segments of sealed `parts`."""
    return [part.name for part in parts if isinstance(part, _shm.Segment)]


def sealed_message(kind: str, ident: int, value: Any, *rest: Any) -> tuple[bytes, list[str]]:
    """`message_bytes((kind, ident, seal(value), *rest))` and the names of the segments
    it carries, which the caller owns from here on (raises what pickling raises,
    after unlinking any it made)."""
    parts = seal(value)
    names = segment_names(parts)
    try:
        return message_bytes((kind, ident, parts, *rest)), names
    except BaseException:
        _shm.unlink(names)
        raise


def open_sealed(parts: list[Any]) -> Any:
    """What `seal` sealed (raises what unpickling raises, or `_shm.SegmentLost` for a
    segment that could not be mapped when the message was read)."""
    for part in parts:
        if isinstance(part, _shm.SegmentLost):
            raise part
    return decode([b"", *parts])


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message (raises `asyncio.IncompleteReadError` at the end of the stream).
    Its segments are mapped and unlinked here, whatever becomes of its call."""
    (count,) = _COUNT.unpack(await reader.readexactly(_COUNT.size))
    frames: list[Any] = []
    for _ in range(count):
        (size,) = _SIZE.unpack(await reader.readexactly(_SIZE.size))
        # writable, so that NumPy arrays made from out-of-band buffers are too
        frames.append(bytearray(await reader.readexactly(size)) if size else bytearray())
    return decode(frames)


def pack_error(exc: BaseException) -> tuple[str, str, tuple[Any, ...], dict[str, Any], str]:
    """`exc` as plain values: its class's module and name, `args`, the attributes that
    can be pickled, and its text. An exception is not pickled whole: most of
    batchproxy's take other arguments than their message, which `pickle` cannot
    replay."""
    kind = type(exc)
    state = {}
    for name, value in vars(exc).items():
        try:
            pickle.dumps(value, protocol=5)
        except Exception:  # an attribute that cannot travel stays behind
            continue
        state[name] = value
    try:
        pickle.dumps(exc.args, protocol=5)
        args = exc.args
    except Exception:
        args = (str(exc),)
    return kind.__module__, kind.__qualname__, args, state, str(exc)


def unpack_error(packed: tuple[str, str, tuple[Any, ...], dict[str, Any], str]) -> BaseException:
    """The exception `pack_error` packed, of the same class when this process can import
    it (without calling its `__init__`), else a `RuntimeError` naming it."""
    module, qualname, args, state, text = packed
    kind: Any = None
    try:
        kind = builtins if module == "builtins" else importlib.import_module(module)
        for part in qualname.split("."):
            kind = getattr(kind, part)
    except Exception:
        kind = None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            exc = kind.__new__(kind)
            exc.args = args
            exc.__dict__.update(state)
            return exc
        except Exception:
            pass
    return RuntimeError(f"{module}.{qualname} in the model host: {text}")
