"""`batchproxy.tensors`' validation and collation as they were before their fast paths
(main at 875a257: `tensors/_items.py` and `tensors/__init__.py`, their validate and
collate parts verbatim but for the imports): the oracle that `tensors/test_fast_paths.py`
holds the library to. Only the pad value check (unchanged) and `Collated` are taken from
the library. Not for anything else: the library's own code is the one in use."""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from batchproxy.tensors import Collated, PaddingSide, _check_pad_value

_Path = tuple[str | int, ...]
_Shape = tuple[int, ...]


def _is_tensor(value: object) -> bool:
    torch_module = sys.modules.get("torch")  # no tensor exists before torch is imported
    tensor_type = getattr(torch_module, "Tensor", None)
    return tensor_type is not None and isinstance(value, tensor_type)


def _is_leaf(value: object) -> bool:
    return isinstance(value, np.ndarray) or _is_tensor(value)


def _shape(leaf: Any) -> _Shape:
    return tuple(int(size) for size in leaf.shape)


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


# -- collate (before) ---------------------------------------------------------------------------


def _region(own: _Shape, padded: _Shape, side: PaddingSide) -> tuple[slice, ...]:
    """Where an item of shape `own` sits inside `padded`."""
    if side == "right":
        return tuple(slice(0, size) for size in own)
    return tuple(slice(full - size, full) for size, full in zip(own, padded, strict=True))


def _collate_leaf(
    leaves: list[Any], pad_value: float | int, side: PaddingSide, multiple: int | None
) -> tuple[Any, _Shape, bool]:
    """Stack one leaf across the items, padding ragged axes: (batch, padded shape, padded?)."""
    shapes = [_shape(leaf) for leaf in leaves]
    first = leaves[0]
    tensor = _is_tensor(first)
    if all(shape == shapes[0] for shape in shapes):
        _check_size(len(leaves), shapes[0], first)
        if tensor:
            import torch

            return torch.stack(leaves), shapes[0], False
        return np.stack(leaves), shapes[0], False
    padded: list[int] = []
    for axis in range(len(shapes[0])):
        sizes = {shape[axis] for shape in shapes}
        size = max(sizes)
        if len(sizes) > 1 and multiple is not None:
            size = -(-size // multiple) * multiple
        padded.append(size)
    target = tuple(padded)
    _check_size(len(leaves), target, first)
    batch: Any
    if tensor:
        import torch

        fill = float(pad_value) if first.dtype.is_floating_point else pad_value  # 10**30
        batch = torch.full((len(leaves), *target), fill, dtype=first.dtype, device=first.device)
    else:
        batch = np.full((len(leaves), *target), pad_value, dtype=first.dtype)
    for index, (leaf, shape) in enumerate(zip(leaves, shapes, strict=True)):
        where = (index, *_region(shape, target, side))
        batch[where] = leaf
    return batch, target, True


def _check_size(count: int, shape: _Shape, leaf: Any) -> None:
    """Refuse, before allocating it, a batch too big to address at all (from huge views)."""
    itemsize = leaf.element_size() if _is_tensor(leaf) else leaf.dtype.itemsize
    size = math.prod((count, *shape)) * itemsize
    if size > sys.maxsize:
        raise ValueError(
            f"a batch of {count} items padded to shape {shape} ({_dtype_name(leaf)}) would take "
            f"{size} bytes, more than can be addressed"
        )


def _mask(lengths: list[int], padded_length: int, side: PaddingSide, like: Any) -> Any:
    if _is_tensor(like):
        import torch

        positions: Any = torch.arange(padded_length, device=like.device)
        sizes: Any = torch.tensor(lengths, device=like.device)
    else:
        positions = np.arange(padded_length)
        sizes = np.asarray(lengths)
    if side == "right":
        return positions[None, :] < sizes[:, None]
    return positions[None, :] >= (padded_length - sizes)[:, None]


def _collate_valid(
    items: Sequence[Any],
    *,
    pad_value: float | int | Mapping[str, float | int],
    padding_side: PaddingSide,
    pad_to_multiple_of: int | None,
) -> Collated:
    """`collate` for items `validate` has passed and arguments already checked."""
    first = items[0]
    paths = [path for path, _ in _leaves(first)]
    if isinstance(pad_value, Mapping) and not isinstance(first, Mapping):
        raise TypeError(
            f"a pad_value mapping needs dict items, got {type(first).__name__} items; "
            "pass one number"
        )
    per_item = [[_leaf_at(item, path) for path in paths] for item in items]
    batched: list[Any] = []
    padded_shapes: list[_Shape] = []
    any_padding = False
    for j, path in enumerate(paths):
        leaves = [leaves_of_item[j] for leaves_of_item in per_item]
        value = pad_value.get(str(path[0]), 0) if isinstance(pad_value, Mapping) else pad_value
        _check_pad_value(value, leaves[0], path)
        batch, padded, did_pad = _collate_leaf(leaves, value, padding_side, pad_to_multiple_of)
        batched.append(batch)
        padded_shapes.append(padded)
        any_padding = any_padding or did_pad
    item_shapes = tuple(tuple(_shape(leaf) for leaf in leaves) for leaves in per_item)
    lengths = [max(shape[0] if shape else 1 for shape in shapes) for shapes in item_shapes]
    padded_length = max(shape[0] if shape else 1 for shape in padded_shapes)
    data: Any
    if isinstance(first, Mapping):
        data = {str(path[0]): batch for path, batch in zip(paths, batched, strict=True)}
    elif isinstance(first, tuple):
        data = tuple(batched)
    else:
        data = batched[0]
    mask = _mask(lengths, padded_length, padding_side, batched[0]) if any_padding else None
    return Collated(
        data=data,
        lengths=lengths,
        mask=mask,
        padded_length=padded_length,
        padding_side=padding_side,
        _paths=tuple(paths),
        _item_shapes=item_shapes,
        _padded_shapes=tuple(padded_shapes),
    )


def _leaf_at(item: Any, path: _Path) -> Any:
    return item[path[0]] if path else item


problems = _problems
collate_valid = _collate_valid
