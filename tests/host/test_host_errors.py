"""A model's errors through a model host: each arrives as the exception it was, with
its message and attributes (`_wire.pack_error`), or, when it cannot be rebuilt here,
as an error whose text names its type and message."""

from __future__ import annotations

import errno
import pickle
import sys
import threading
from typing import Any

import pytest
from typing_extensions import override

import batchproxy
from batchproxy.host import ModelHost, RemoteProxy
from batchproxy.host._wire import pack_error, unpack_error

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="Unix domain sockets"),
    pytest.mark.usefixtures("no_leftovers"),
]


def _travelled(exc: BaseException) -> BaseException:
    """`exc` as a client gets it: packed, pickled (as the message is), unpacked."""
    return unpack_error(pickle.loads(pickle.dumps(pack_error(exc), protocol=5)))


class NeedsTwo(Exception):
    """Takes other arguments than its message (as batchproxy's own errors do)."""

    def __init__(self, what: str, count: int) -> None:
        super().__init__(f"{what} x{count}")
        self.what = what
        self.count = count


class HoldsALambda(OSError):
    """An attribute that cannot be pickled: the exception cannot travel whole."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.callback = lambda: None


class Slotted(Exception):
    """Keeps its field in a slot, which `pickle` does not see (nor can its `__init__`
    be replayed from its `args`)."""

    __slots__ = ("field",)

    def __init__(self, field: str) -> None:
        super().__init__()
        self.field = field

    def __str__(self) -> str:
        return f"slotted {self.field}"


def test_os_errors_keep_errno_strerror_and_filename() -> None:
    original = FileNotFoundError(errno.ENOENT, "No such file or directory", "weights.bin")
    got = _travelled(original)
    assert type(got) is FileNotFoundError
    assert (got.errno, got.strerror) == (errno.ENOENT, original.strerror)
    assert got.filename == "weights.bin"
    assert str(got) == str(original)


def test_unicode_errors_keep_their_fields_and_message() -> None:
    try:
        b"\xff".decode("utf-8")
    except UnicodeDecodeError as exc:
        original = exc
    got = _travelled(original)
    assert type(got) is UnicodeDecodeError
    assert str(got) == str(original) != ""
    assert (got.encoding, got.object, got.start, got.end, got.reason) == (  # type: ignore[attr-defined]
        "utf-8",
        b"\xff",
        0,
        1,
        original.reason,
    )


def test_errors_whose_init_takes_other_arguments_keep_theirs() -> None:
    got = _travelled(NeedsTwo("apples", 3))
    assert type(got) is NeedsTwo
    assert (got.what, got.count, str(got)) == ("apples", 3, "apples x3")
    closed = _travelled(batchproxy.DrainDeadline("model", 2.0, running=True))
    assert type(closed) is batchproxy.DrainDeadline
    assert closed.running is True
    assert closed.timeout == 2.0
    full = _travelled(batchproxy.QueueFull("model", 8))
    assert type(full) is batchproxy.QueueFull
    assert str(full) == str(batchproxy.QueueFull("model", 8))


def test_an_os_error_with_an_attribute_that_cannot_travel_keeps_the_rest() -> None:
    got = _travelled(HoldsALambda(errno.EACCES, "Permission denied", "/weights"))
    assert type(got) is HoldsALambda
    assert (got.errno, got.strerror) == (errno.EACCES, "Permission denied")
    assert got.filename == "/weights"
    assert str(got) == "[Errno 13] Permission denied: '/weights'"
    assert not hasattr(got, "callback")


class Unrebuildable(Exception):
    """Its text needs an attribute that cannot be pickled: it cannot be rebuilt."""

    def __init__(self, lock: Any) -> None:
        super().__init__()
        self.lock = lock

    def __str__(self) -> str:
        return f"stuck on {type(self.lock).__name__}"


def test_an_error_kept_in_slots_is_rebuilt_with_them() -> None:
    got = _travelled(Slotted("value"))
    assert type(got) is Slotted
    assert (got.field, str(got)) == ("value", "slotted value")


def test_an_error_that_cannot_be_rebuilt_names_its_type_and_message() -> None:
    got = _travelled(Unrebuildable(threading.Lock()))
    assert type(got) is RuntimeError
    assert str(got) == f"{__name__}.Unrebuildable in the model host: stuck on lock"


def test_an_error_class_the_caller_cannot_import_names_its_type_and_message() -> None:
    module, _, text, whole, fields = pack_error(NeedsTwo("bad thing", 2))
    assert whole is None  # (its fields travel)
    got = unpack_error((module, "NoSuchError", text, whole, fields))
    assert type(got) is RuntimeError
    assert str(got) == f"{__name__}.NoSuchError in the model host: bad thing x2"
    # pickled whole, of a class this process cannot import
    _, _, text, whole, fields = pack_error(ValueError("bad value"))
    assert whole is not None
    whole = whole.replace(b"ValueError", b"ValueErrox")
    got = unpack_error(("builtins", "ValueErrox", text, whole, fields))
    assert str(got) == "builtins.ValueErrox in the model host: bad value"


class Failing(batchproxy.Proxy[Any, Any]):
    """Fails each item with the error its item names."""

    def __init__(self) -> None:
        super().__init__(8, max_delay_ms=1.0)

    @override
    async def _inference(self, items: list[Any]) -> list[Any]:
        out: list[Any] = []
        for item in items:
            if item == "missing":
                out.append(FileNotFoundError(errno.ENOENT, "No such file or directory", "w.bin"))
            elif item == "undecodable":
                try:
                    b"\xff".decode("utf-8")
                except UnicodeDecodeError as exc:
                    out.append(exc)
            else:
                out.append(Unrebuildable(threading.Lock()))
        return out


async def test_the_models_errors_arrive_whole_through_a_host(socket_path: str) -> None:
    async with ModelHost(Failing(), socket_path), RemoteProxy(socket_path) as remote:
        with pytest.raises(FileNotFoundError) as missing:
            await remote.inference("missing")
        assert (missing.value.errno, missing.value.filename) == (errno.ENOENT, "w.bin")
        with pytest.raises(UnicodeDecodeError, match="can't decode byte 0xff"):
            await remote.inference("undecodable")
        with pytest.raises(RuntimeError, match="Unrebuildable in the model host: stuck on lock"):
            await remote.inference("other")
