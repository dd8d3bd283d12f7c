"""Items of a batch, one by one: their arrays (leaves), and whether each can join the
others (the checks behind `tensors.validate`, whose messages describe the item
itself, not its place in a batch). The usual batch, items alike down to the exact
types, is recognised cheaply first (`_alike`); any other goes through the full check."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, eq, is_
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

import numpy as np

if TYPE_CHECKING:
    import torch

_Path = tuple[str | int, ...]
"""Where a leaf sits in an item: `()` for a lone array, `(key,)` in a dict, `(i,)` in a tuple."""

_Shape = tuple[int, ...]


# -- leaves -----------------------------------------------------------------------------------


_tensor_types: list[type] = []
"""`[torch.Tensor]` once torch has been imported (by the user: never here), else empty."""


def _tensor_type() -> type | None:
    """`torch.Tensor` if torch is imported: no tensor exists before it is."""
    if not _tensor_types:
        found = getattr(sys.modules.get("torch"), "Tensor", None)
        if not isinstance(found, type):
            return None
        _tensor_types.append(found)
    return _tensor_types[0]


def _is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    tensor_type = _tensor_types[0] if _tensor_types else _tensor_type()
    return tensor_type is not None and isinstance(value, tensor_type)


def _is_leaf(value: object) -> bool:
    return isinstance(value, np.ndarray) or _is_tensor(value)


def _shape(leaf: Any) -> _Shape:
    return tuple(map(int, leaf.shape))


def _library(leaf: Any) -> str:
    return "torch" if _is_tensor(leaf) else "numpy"


def _dtype_name(leaf: Any) -> str:
    return str(leaf.dtype).removeprefix("torch.")


def _device(leaf: Any) -> str:
    return str(leaf.device) if _is_tensor(leaf) else "cpu"


def _leaves(item: object) -> list[tuple[_Path, Any]]:
    """The arrays of one item with their paths, in the item's own order.

    Raises `TypeError` for an unsupported item (naming its type) and `ValueError`
    for an empty dict or tuple.
    """
    if _is_leaf(item):
        return [((), item)]
    if isinstance(item, Mapping):
        found: list[tuple[_Path, Any]] = []
        for key, value in item.items():
            if not isinstance(key, str):
                raise TypeError(f"dict keys must be str, got {type(key).__name__} {key!r}")
            if not _is_leaf(value):
                raise TypeError(
                    f"key {key!r} holds a {type(value).__name__}; "
                    "dict values must be NumPy arrays or torch tensors"
                )
            found.append(((key,), value))
        if not found:
            raise ValueError("an empty dict has nothing to batch")
        return found
    if isinstance(item, tuple):
        for index, value in enumerate(item):
            if not _is_leaf(value):
                raise TypeError(
                    f"element {index} is a {type(value).__name__}; "
                    "tuple elements must be NumPy arrays or torch tensors"
                )
        if not item:
            raise ValueError("an empty tuple has nothing to batch")
        return [((index,), value) for index, value in enumerate(item)]
    raise TypeError(
        f"cannot batch a {_type_name(item)}: items must be "
        "NumPy arrays, torch tensors, dict[str, array] or tuples of arrays"
    )


def _check_items(function: str, items: object) -> None:
    """`items` is a list (or another sequence) of items, not one item or an iterator."""
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes, bytearray)):
        raise TypeError(
            f"{function} takes a list of items, got {_type_name(items)}; "
            "pass [item] for a single item"
        )


def _type_name(value: object) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


# -- validate ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LeafSignature:
    library: str
    ndim: int
    dtype: str
    device: str


@dataclass(frozen=True)
class _Signature:
    kind: Literal["array", "dict", "tuple"]
    keys: tuple[str, ...]  # sorted dict keys, else ()
    leaves: tuple[_LeafSignature, ...]  # in sorted key order for dicts


def _sorted_leaves(item: object) -> list[tuple[_Path, Any]]:
    found = _leaves(item)
    return sorted(found, key=lambda pair: str(pair[0][0])) if isinstance(item, Mapping) else found


def _signature(item: object) -> _Signature:
    found = _sorted_leaves(item)
    kind: Literal["array", "dict", "tuple"] = (
        "dict" if isinstance(item, Mapping) else "tuple" if isinstance(item, tuple) else "array"
    )
    keys = tuple(str(path[0]) for path, _ in found) if kind == "dict" else ()
    leaves = tuple(
        _LeafSignature(_library(leaf), len(leaf.shape), _dtype_name(leaf), _device(leaf))
        for _, leaf in found
    )
    return _Signature(kind, keys, leaves)


_LIKE_THE_OTHERS = "like the other items in its batch"


def _kind_name(signature: _Signature) -> str:
    if signature.kind == "dict":
        return f"a dict with keys {list(signature.keys)}"
    if signature.kind == "tuple":
        count = len(signature.leaves)
        return f"a tuple of {count} array{'' if count == 1 else 's'}"
    return _library_name(signature.leaves[0].library)


def _library_name(library: str) -> str:
    return "a torch tensor" if library == "torch" else "a NumPy array"


def _describe(leaf: Any) -> str:
    """What one leaf is: `a NumPy array of dtype float64 and shape (3,)`."""
    return f"{_library_name(_library(leaf))} of dtype {_dtype_name(leaf)} and shape {_shape(leaf)}"


def _subject(path: _Path) -> str:
    if not path:
        return ""
    if isinstance(path[0], str):
        return f"key {path[0]!r}: "
    return f"element {path[0]}: "


def _mismatch(
    item: object, signature: _Signature, reference: object, expected: _Signature
) -> Exception:
    """Why `item` (with `signature`) cannot join a batch of items like `reference`: what
    was expected and what the item is, without its position (the caller sent one item)."""
    if signature.kind != expected.kind or (
        signature.kind == "array" and signature.leaves[0].library != expected.leaves[0].library
    ):
        what = _describe(item) if signature.kind == "array" else _kind_name(signature)
        return TypeError(f"expected {_kind_name(expected)} {_LIKE_THE_OTHERS}, got {what}")
    if signature.keys != expected.keys:
        missing = ", ".join(repr(key) for key in expected.keys if key not in signature.keys)
        extra = ", ".join(repr(key) for key in signature.keys if key not in expected.keys)
        details = "; ".join(
            part for part in (missing and f"missing {missing}", extra and f"extra {extra}") if part
        )
        return ValueError(
            f"expected {_kind_name(expected)} {_LIKE_THE_OTHERS}, "
            f"got keys {list(signature.keys)} ({details})"
        )
    if len(signature.leaves) != len(expected.leaves):
        return ValueError(
            f"expected {_kind_name(expected)} {_LIKE_THE_OTHERS}, got {_kind_name(signature)}"
        )
    pairs = zip(
        _sorted_leaves(item),
        _sorted_leaves(reference),
        signature.leaves,
        expected.leaves,
        strict=True,
    )
    for (path, leaf), (_, reference_leaf), got, want in pairs:
        subject = _subject(path)
        if got.library != want.library:
            return TypeError(
                f"{subject}expected {_library_name(want.library)} {_LIKE_THE_OTHERS}, "
                f"got {_describe(leaf)}"
            )
        if got.device != want.device:
            return ValueError(
                f"{subject}expected a tensor on {want.device} {_LIKE_THE_OTHERS}, "
                f"got {_describe(leaf)} on {got.device}"
            )
        if got.ndim != want.ndim:
            return ValueError(
                f"{subject}expected rank {want.ndim} {_LIKE_THE_OTHERS} "
                f"(e.g. shape {_shape(reference_leaf)}), got rank {got.ndim}: {_describe(leaf)}"
            )
        if got.dtype != want.dtype:
            return TypeError(
                f"{subject}expected dtype {want.dtype} {_LIKE_THE_OTHERS}, got {_describe(leaf)}"
            )
    raise AssertionError("signatures differ but no difference found")  # pragma: no cover


def _problems(items: Sequence[Any]) -> list[Exception | None]:
    """`validate` without the positions: each error describes the item alone, for a
    caller that sent that one item (`TensorProxy`)."""
    if items and _alike(items):  # the usual batch, without building signatures
        return [None] * len(items)
    signatures: list[_Signature | Exception] = []
    for item in items:
        try:
            signatures.append(_signature(item))
        except (TypeError, ValueError) as error:
            signatures.append(error)
    counts = Counter(s for s in signatures if isinstance(s, _Signature))
    if not counts:
        return [s if isinstance(s, Exception) else None for s in signatures]
    most = max(counts.values())
    expected = next(s for s in signatures if isinstance(s, _Signature) and counts[s] == most)
    reference = items[signatures.index(expected)]
    errors: list[Exception | None] = []
    for item, signature in zip(items, signatures, strict=True):
        if isinstance(signature, Exception):
            errors.append(signature)
        elif signature == expected:
            errors.append(None)
        else:
            errors.append(_mismatch(item, signature, reference, expected))
    return errors


# -- the usual batch, cheaply -----------------------------------------------------------------

_Spec = tuple[Any, int, Any, Any]
"""A leaf's exact type, rank, dtype object and device (None for a NumPy array)."""


def _spec(leaf: Any) -> _Spec | None:
    """What `_alike` compares of a leaf of exactly `np.ndarray` or `torch.Tensor`; None for
    anything else (a subclass, or not a leaf), which `_alike` leaves to the full check."""
    kind = type(leaf)
    if kind is np.ndarray:
        return kind, leaf.ndim, leaf.dtype, None
    if kind is _tensor_type():
        return kind, leaf.ndim, leaf.dtype, leaf.device
    return None


def _alike(items: Sequence[Any]) -> bool:
    """Whether every item is a valid item alike the first, shown cheaply: each is of the
    first's exact type (an exact `np.ndarray` or `torch.Tensor`, a `dict` with exactly
    `str` keys in the same order, or a `tuple` of as many leaves), and each leaf has the
    exact type, rank, dtype (the same object) and device of the first item's.

    True implies every `_signature` is valid and equal to the first's; False says
    nothing (a subclass, another key order, any difference, an invalid item): the full
    check then decides, so its verdicts and messages are the only ones.
    """
    first = items[0]
    kind = type(first)
    if not all(map(is_, map(type, items), repeat(kind))):
        return False
    columns: list[Sequence[Any]]  # columns[j][i]: item i's j-th leaf
    if kind is dict:
        keys = tuple(first)
        if any(type(key) is not str for key in keys):
            return False
        for item in items:
            if len(item) != len(keys) or not (
                all(map(is_, item, keys)) or all(map(_same_key, item, keys))
            ):
                return False
        columns = [[item[key] for item in items] for key in keys]
    elif kind is tuple:
        if any(len(item) != len(first) for item in items):
            return False
        columns = [[item[j] for item in items] for j in range(len(first))]
    else:
        columns = [items]
    for column in columns:
        spec = _spec(column[0])
        if spec is None:
            return False
        leaf_type, ndim, dtype, device = spec
        if len(column) > 1 and not (  # (a lone item is alike itself)
            all(map(is_, map(type, column), repeat(leaf_type)))
            and all(map(is_, map(_dtype, column), repeat(dtype)))
            and all(map(eq, map(_ndim, column), repeat(ndim)))
            and (device is None or all(map(eq, map(_device_of, column), repeat(device))))
        ):
            return False
    return bool(columns)  # (an empty dict or tuple is not valid)


_dtype, _ndim, _device_of = attrgetter("dtype"), attrgetter("ndim"), attrgetter("device")


def _same_key(key: object, want: str) -> bool:
    """`key` is the str `want` (an exact str: a subclass may show itself otherwise)."""
    return type(key) is str and key == want
