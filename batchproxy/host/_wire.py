"""The messages between a `RemoteProxy` and its `ModelHost`, on a Unix domain socket.

A message is a tuple, pickled as the worker pipes' messages are (`_executors.ipc`:
protocol 5, each large buffer out of band, never copied into the pickle); on the
socket it is the frame count, each frame's length, then the frames' bytes (the
pickle, then each buffer), read in three reads whatever the count.

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
import contextlib
import importlib
import pickle
import struct
import types
from typing import Any

from .._executors.ipc import pickled
from . import _shm

__all__ = [
    "MessageReader",
    "Outbox",
    "Packed",
    "answer_message",
    "message_bytes",
    "open_sealed",
    "owned",
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
    is written (so a message that cannot be sent leaves the socket in step). Its values
    are sealed already (`seal`): the message itself is pickled as it is.

    Returned as one `bytes`, with no view into the pickled buffers left behind: a
    memoryview of a `PickleBuffer` that outlives this call can end up in a reference
    cycle (an exception's traceback, a frame), and CPython 3.12.1's collector then
    released the buffer under the view (a segfault, seen in this package's tests)."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    frames = [memoryview(data), *(buffer.raw() for buffer in buffers)]
    sizes = [frame.nbytes for frame in frames]
    try:
        return b"".join([struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes), *frames])
    finally:
        for frame in frames:
            frame.release()
        del frames


def seal(value: Any) -> list[Any]:
    """`value` pickled on its own, to travel inside a message (raises what pickling
    raises, before any segment is made): the pickle and each buffer as a
    `PickleBuffer`, or a buffer of `_shm.THRESHOLD` bytes or more copied into a
    shared-memory segment, as its `_shm.Segment`. The caller owns those segments
    (`segment_names`): it writes them on a connection or unlinks them."""
    frames = pickled(value)
    parts: list[Any] = [pickle.PickleBuffer(frames[0])]
    try:
        for view in frames[1:]:
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


def owned(parts: list[Any]) -> list[Any]:
    """Sealed `parts` with each `PickleBuffer` copied to `bytes`: for parts kept across
    awaits inside a list's message (a `PickleBuffer` that ends up in a reference cycle
    crashed CPython 3.12.1's collector: see `message_bytes`)."""
    return [bytes(part) if isinstance(part, pickle.PickleBuffer) else part for part in parts]


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


def answer_message(kind: str, ident: int, value: Any) -> tuple[tuple[Any, ...], list[str]]:
    """`(kind, ident, owned(seal(value)))`, to queue in an `Outbox`, and the names of the
    segments it carries, which the caller owns from here on (raises what pickling
    raises, after unlinking any it made)."""
    parts = owned(seal(value))
    return (kind, ident, parts), segment_names(parts)


def open_sealed(parts: list[Any]) -> Any:
    """What `seal` sealed (raises what unpickling raises, or `_shm.SegmentLost` for a
    segment that could not be mapped when the message was read)."""
    for part in parts:
        if isinstance(part, _shm.SegmentLost):
            raise part
    # (a buffer that came in band, as `owned` sends it, is copied: writable, as the
    # arrays made from buffers that came out of band are)
    buffers = [bytearray(part) if isinstance(part, bytes) else part for part in parts[1:]]
    return pickle.loads(parts[0], buffers=buffers)


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message as written (raises `asyncio.IncompleteReadError` at the end of
    the stream; a `("batch", [message, ...])` is not taken apart: `MessageReader` does).
    Its segments are mapped and unlinked here, whatever becomes of its call."""
    (count,) = _COUNT.unpack(await reader.readexactly(_COUNT.size))
    sizes = struct.unpack(f"<{count}Q", await reader.readexactly(_SIZE.size * count))
    data = await reader.readexactly(sum(sizes))
    frames: list[Any] = []
    start = 0
    with memoryview(data) as view:
        for size in sizes:
            # writable, so that NumPy arrays made from out-of-band buffers are too
            frames.append(bytearray(view[start : start + size]))
            start += size
    return pickle.loads(frames[0], buffers=frames[1:])


class MessageReader:
    """The messages of one stream, read in bulk: `next()` returns every message that
    has arrived whole (one read of the socket for many messages, the usual case when
    calls or answers are in flight together), at least one."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.buffer = bytearray()

    async def next(self) -> list[Any]:
        """The messages read next, in order (raises `asyncio.IncompleteReadError` at the
        end of the stream, as `read_message`). Their segments are mapped and unlinked
        here, whatever becomes of their calls."""
        while True:
            messages = self._parse()
            if messages:
                return messages
            want = self._missing()
            if want > _BULK:  # a large message: the rest of it at once
                data = await self.reader.readexactly(want)
            else:
                data = await self.reader.read(_BULK)
                if not data:
                    raise asyncio.IncompleteReadError(bytes(self.buffer), None)
            self.buffer += data

    def _missing(self) -> int:
        """How many bytes the first message still lacks (at least 1)."""
        buffer = self.buffer
        if len(buffer) < _COUNT.size:
            return _COUNT.size - len(buffer)
        count: int = _COUNT.unpack_from(buffer)[0]
        head = _COUNT.size + _SIZE.size * count
        if len(buffer) < head:
            return head - len(buffer)
        total: int = head + sum(struct.unpack_from(f"<{count}Q", buffer, _COUNT.size))
        return max(1, total - len(buffer))

    def _parse(self) -> list[Any]:
        buffer = self.buffer
        messages: list[Any] = []
        start = 0
        with memoryview(buffer) as view:
            while len(buffer) - start >= _COUNT.size:
                (count,) = _COUNT.unpack_from(buffer, start)
                head = start + _COUNT.size + _SIZE.size * count
                if len(buffer) < head:
                    break
                sizes = struct.unpack_from(f"<{count}Q", buffer, start + _COUNT.size)
                if len(buffer) < head + sum(sizes):
                    break
                frames: list[Any] = []
                for size in sizes:
                    # writable, so that NumPy arrays made from out-of-band buffers are too
                    frames.append(bytearray(view[head : head + size]))
                    head += size
                start = head
                message = pickle.loads(frames[0], buffers=frames[1:])
                if message[0] == "batch":  # (an `Outbox`'s: the messages in it, in order)
                    messages.extend(message[1])
                else:
                    messages.append(message)
                del message
        if start:
            del buffer[:start]
        return messages


class Outbox:
    """The messages for one stream, written together: `put` queues a message (its values
    sealed and owned: `answer_message`), and when the loop next runs its callbacks all
    those queued go as one `("batch", [message, ...])` message in one write (one
    pickling, one system call and one wakeup of the reader for a batch's answers).
    `flush` writes them now (before waiting for room, or closing)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, writer: asyncio.StreamWriter) -> None:
        self.loop = loop
        self.writer = writer
        self._pending: list[tuple[Any, ...]] = []
        self._bytes = 0

    def put(self, message: tuple[Any, ...]) -> None:
        if not self._pending:
            self.loop.call_soon(self.flush)
        self._pending.append(message)
        self._bytes += _ENVELOPE + _size(message)

    def size(self) -> int:
        """Bytes queued here (about) and in the transport, not yet sent."""
        return self._bytes + self.writer.transport.get_write_buffer_size()

    def flush(self) -> None:
        """Write what is queued (dropped if the transport is closing: the other end is
        gone, or this one closes). Nothing in it can fail to pickle: its values are
        sealed already, the rest are the library's own plain values."""
        pending, self._pending, self._bytes = self._pending, [], 0
        if pending and not self.writer.is_closing():
            message = pending[0] if len(pending) == 1 else ("batch", pending)
            self.writer.write(message_bytes(message))


_ENVELOPE = 64  # (bytes a message adds to the values it carries, about)


def _size(message: tuple[Any, ...]) -> int:
    """The bytes of a message's sealed values (its parts, or a list's entries' parts),
    about: segments and the rest count for nothing."""
    if len(message) < 3:
        return 0
    if message[0] == "results":
        return sum(_parts_size(parts) for _, parts in message[2])
    return _parts_size(message[2])


def _parts_size(parts: list[Any]) -> int:
    return sum([len(part) for part in parts if type(part) is bytes])


_BULK = 1 << 16
"""Bytes asked of the stream at a time (a message larger than that: all of its rest)."""


Packed = tuple[str, str, str, bytes | None, bytes | None]
"""A packed exception (`pack_error`): its class's module and name, its text, and the
exception pickled whole or, if it cannot travel so, its fields pickled."""


def pack_error(exc: BaseException) -> Packed:
    """`exc` as plain values, in the first form that rebuilds it (checked here, in the
    process that raised it):

    1. pickled whole, if unpickling that gives an exception of the same class, `args`,
       attributes and text (a `FileNotFoundError`'s `errno`, a `UnicodeDecodeError`'s
       fields: what their class's `__reduce__` replays);
    2. else its fields, pickled: `args`, the values of its class's slots (the C-level
       fields of `OSError` and `UnicodeError`, `__slots__`) and the attributes in its
       `__dict__`, each that can be pickled (most of batchproxy's errors take other
       arguments than their message, which `pickle` cannot replay);
    3. and always its class's name and its text, so that an exception the receiver
       cannot rebuild still arrives with both (`unpack_error`)."""
    kind = type(exc)
    text = _text(exc)
    whole = _whole(exc, text)
    fields = None if whole is not None else _fields(exc)
    return kind.__module__, kind.__qualname__, text, whole, fields


def unpack_error(packed: Packed) -> BaseException:
    """The exception `pack_error` packed: unpickled whole, or of the same class (if this
    process can import it) with its fields set, without calling its `__init__`; one
    that cannot be rebuilt here with the same text is a `RuntimeError` whose text
    names its class and its text."""
    module, qualname, text, whole, fields = packed
    if whole is not None:
        try:
            exc = pickle.loads(whole)
            if isinstance(exc, Exception):
                return exc
        except Exception:
            pass
    kind = _class(module, qualname)
    if fields is not None and isinstance(kind, type) and issubclass(kind, Exception):
        try:
            args, slots, state = pickle.loads(fields)
            exc = kind.__new__(kind)
            exc.args = args
            for name, value in slots.items():
                with contextlib.suppress(Exception):  # (a read-only one stays as it is)
                    # (an OSError's filename2 reads None unset, and prints set to None)
                    if value is not None or getattr(exc, name, True) is not None:
                        setattr(exc, name, value)
            exc.__dict__.update(state)
            if _text(exc) == text:
                return exc
        except Exception:
            pass
    return RuntimeError(f"{module}.{qualname} in the model host: {text}")


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__qualname__} whose str() raised>"


def _whole(exc: BaseException, text: str) -> bytes | None:
    """`exc` pickled, if it unpickles as the same exception (class, `args`, `__dict__`
    and text); else None."""
    try:
        data = pickle.dumps(exc, protocol=5)
        copy = pickle.loads(data)
        same = (
            type(copy) is type(exc)
            and _text(copy) == text
            and pickle.dumps((copy.args, vars(copy)), protocol=5)
            == pickle.dumps((exc.args, vars(exc)), protocol=5)
        )
    except Exception:
        return None
    return data if same else None


def _fields(exc: BaseException) -> bytes | None:
    """`exc`'s `args`, slots and `__dict__` pickled (each that pickles); None if not
    even that can be."""

    def travels(value: Any) -> bool:
        try:
            pickle.dumps(value, protocol=5)
        except Exception:
            return False
        return True

    args = exc.args if travels(exc.args) else (_text(exc),)
    slots = {}
    for name in _slots(type(exc)):
        try:
            value = getattr(exc, name)
        except Exception:  # (an OSError's characters_written, when not set)
            continue
        if travels(value):
            slots[name] = value
    state = {name: value for name, value in vars(exc).items() if travels(value)}
    try:
        return pickle.dumps((args, slots, state), protocol=5)
    except Exception:
        return None


def _slots(kind: type) -> tuple[str, ...]:
    """The fields `kind` keeps outside `__dict__` and `args`: its classes' slots and
    C-level members (not `BaseException`'s own: traceback, cause, context)."""
    names: list[str] = []
    for klass in kind.__mro__:
        if klass in (BaseException, object):
            continue
        for name, attribute in vars(klass).items():
            if name in ("__dict__", "__weakref__") or name in names:
                continue
            if isinstance(attribute, (types.MemberDescriptorType, types.GetSetDescriptorType)):
                names.append(name)
    return tuple(names)


def _class(module: str, qualname: str) -> Any:
    """The class `module.qualname`, if this process can import it; else None."""
    try:
        kind: Any = builtins if module == "builtins" else importlib.import_module(module)
        for part in qualname.split("."):
            kind = getattr(kind, part)
    except Exception:
        return None
    return kind
