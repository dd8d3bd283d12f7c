"""Collate, pad and split NumPy arrays and torch tensors for batched models.

Items are NumPy arrays, torch tensors, `dict[str, array]` feature dicts or tuples
of arrays; all items of one batch share that structure. torch is never imported
here: a torch tensor can only exist once its user has imported torch.

The rules:

- `collate(items)` stacks same-shape items on a new batch axis. Items whose sizes
  differ on some axes (ragged axes; any axis may be one) are padded with
  `pad_value` to the longest on each ragged axis, at the end (`"right"`) or the
  start (`"left"`) of that axis, then stacked; `pad_to_multiple_of` rounds each
  padded ragged axis up. Axis 0 of an item is its sequence axis: `lengths`
  holds each item's size there (the largest over the leaves of a dict or
  tuple), and `mask` is `True` on its real positions.
- dtype and device are kept exactly; NumPy and torch are never mixed.
- `split(outputs, collated)` hands back one output per item: row `i` of every
  array in `outputs` (nested in dicts, tuples and lists as you like), un-padded
  as described in `split`.
- `validate(items)` finds the items that cannot be batched with the rest
  (another type or library, other dict keys, another rank, dtype or device of
  a leaf), measured against the most common structure, so one bad item never
  fails the good ones. `collate` raises the first such error.
- `length(item)` is the item's cost for length-aware batching: its size along
  axis 0, the largest over its leaves.

The package's private modules check items (`_items`), choose and check pad values
(`_pad_values`) and add or cut filler rows (`_rows`); `TensorProxy`, which uses these
tools, sits above them (`_tensor_proxy`). One item alone is stacked without the
comparisons a batch needs (`_collate_lone`); the tests hold it to the general way.

May import: `_validate`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .. import _validate
from ._items import (
    _check_items,
    _dtype_name,
    _is_leaf,
    _is_tensor,
    _leaves,
    _Path,
    _problems,
    _Shape,
    _shape,
    _type_name,
)
from ._pad_values import check_pad_value, pad_value_for

__all__ = ["Collated", "PaddingSide", "collate", "length", "split", "validate"]

PaddingSide = Literal["right", "left"]


@dataclass(frozen=True, eq=False)
class Collated:
    """A collated batch and what `split` needs to hand each item its own output.

    - `data`: the batch: one array/tensor, a `dict[str, array]` or a tuple of them,
      with the batch on axis 0.
    - `lengths`: each item's size along its sequence axis (axis 0 of the item; the
      largest over the leaves of a dict or tuple).
    - `mask`: a bool array/tensor of shape `(n, padded_length)`, same library and
      device as `data`, `True` on each item's real positions; `None` when nothing
      was padded.
    - `padded_length`: the padded size of the sequence axis (axis 1 of the batch).
    - `padding_side`: where the padding went.
    """

    data: Any
    lengths: list[int]
    mask: Any | None
    padded_length: int
    padding_side: PaddingSide
    _paths: tuple[_Path, ...] = field(default=(), repr=False)
    _item_shapes: tuple[tuple[_Shape, ...], ...] = field(default=(), repr=False)
    """`_item_shapes[i][j]`: the shape of item i's leaf at `_paths[j]`."""
    _padded_shapes: tuple[_Shape, ...] = field(default=(), repr=False)
    """The padded shape (without the batch axis) of the leaf at `_paths[j]`."""


def validate(items: Sequence[Any]) -> list[Exception | None]:
    """Per item: `None` if it can be batched with the others, else the error saying why,
    starting with the item's position in `items` (`item 2: ...`).

    Items are measured against the most common structure among them (ties: the
    earliest), so one odd item fails alone. `TypeError` for another type, library
    or dtype; `ValueError` for other dict keys, rank, device, or an empty dict or
    tuple. Sizes never matter: every axis may be ragged.
    """
    _check_items("validate", items)
    return [
        None if error is None else type(error)(f"item {index}: {error}")
        for index, error in enumerate(_problems(items))
    ]


# -- collate ----------------------------------------------------------------------------------


def _region(own: _Shape, padded: _Shape, side: PaddingSide) -> tuple[slice, ...]:
    """Where an item of shape `own` sits inside `padded`."""
    if side == "right":
        return tuple(slice(0, size) for size in own)
    return tuple(slice(full - size, full) for size, full in zip(own, padded, strict=True))


def _collate_leaf(
    leaves: list[Any],
    shapes: list[_Shape],
    pad_value: float | int,
    multiple: int | None,
    real: _RealPositions,
) -> tuple[Any, _Shape, bool]:
    """Stack one leaf (of shapes `shapes`) across the items, padding ragged axes:
    (batch, padded shape, padded?)."""
    first = leaves[0]
    tensor = _is_tensor(first)
    reference = shapes[0]
    if all(shape == reference for shape in shapes):
        _check_size(len(leaves), reference, first)
        return _stacked(leaves), reference, False
    padded: list[int] = []
    for axis in range(len(reference)):
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
    if _fits_one_copy(first, tensor, shapes):
        # the batch's real positions (the mask of these sizes), in order, take the items'
        # rows one after another: one copy for the whole batch, not one per item
        positions = real([shape[0] for shape in shapes], target[0])
        if tensor:
            rows = torch.from_numpy(positions).view(*positions.shape, *[1] * (len(target) - 1))
            batch.masked_scatter_(rows, torch.cat(leaves))
        else:
            batch[positions] = np.concatenate(leaves)
        return batch, target, True
    for index, (leaf, shape) in enumerate(zip(leaves, shapes, strict=True)):
        where = (index, *_region(shape, target, real.side))
        batch[where] = leaf
    return batch, target, True


def _stacked(leaves: list[Any]) -> Any:
    """Same-shape leaves on a new batch axis (a copy), in their own library."""
    if _is_tensor(leaves[0]):
        import torch

        return torch.stack(leaves)
    return np.stack(leaves)


def _fits_one_copy(first: Any, tensor: bool, shapes: list[_Shape]) -> bool:
    """Whether a ragged leaf can take its items' rows in one copy: ragged on axis 0
    alone, and on the CPU. (Otherwise each item is placed in its region; the tests
    compare the two ways by turning this one off.)"""
    reference = shapes[0]
    axis_0_alone = len(reference) == 1 or all(shape[1:] == reference[1:] for shape in shapes)
    return axis_0_alone and (not tensor or first.device.type == "cpu")


def _check_size(count: int, shape: _Shape, leaf: Any) -> None:
    """Refuse, before allocating it, a batch too big to address at all (from huge views)."""
    itemsize = leaf.element_size() if _is_tensor(leaf) else leaf.dtype.itemsize
    size = math.prod((count, *shape)) * itemsize
    if size > sys.maxsize:
        raise ValueError(
            f"a batch of {count} items padded to shape {shape} ({_dtype_name(leaf)}) would take "
            f"{size} bytes, more than can be addressed"
        )


def _mask(lengths: list[int], padded_length: int, real: _RealPositions, like: Any) -> Any:
    """The batch's mask, in `like`'s library and on its device."""
    if not _is_tensor(like):
        return real(lengths, padded_length)
    import torch

    if like.device.type == "cpu":
        return torch.from_numpy(real(lengths, padded_length))
    positions: Any = torch.arange(padded_length, device=like.device)
    sizes: Any = torch.tensor(lengths, device=like.device)
    if real.side == "right":
        return positions[None, :] < sizes[:, None]
    return positions[None, :] >= (padded_length - sizes)[:, None]


class _RealPositions:
    """`(n, padded_length)` NumPy bools, `True` on each item's real positions along a
    padded axis, for one `collate` call: made once per (sizes, padded length), which a
    batch's leaves and its mask often share. Only read, never written."""

    __slots__ = ("_made", "side")

    def __init__(self, side: PaddingSide) -> None:
        self.side: PaddingSide = side
        self._made: dict[tuple[tuple[int, ...], int], np.ndarray[Any, Any]] = {}

    def __call__(self, sizes: list[int], padded_length: int) -> np.ndarray[Any, Any]:
        key = (tuple(sizes), padded_length)
        found = self._made.get(key)
        if found is None:
            positions = np.arange(padded_length)
            counts = np.asarray(sizes)
            if self.side == "right":
                found = positions[None, :] < counts[:, None]
            else:
                found = positions[None, :] >= (padded_length - counts)[:, None]
            self._made[key] = found
        return found


def collate(
    items: Sequence[Any],
    *,
    pad_value: float | int | Mapping[str, float | int] = 0,
    padding_side: PaddingSide = "right",
    pad_to_multiple_of: int | None = None,
) -> Collated:
    """Stack `items` into one batch, padding ragged axes; see the module docstring.

    `pad_value` is one number for every leaf, or a mapping from dict key to pad
    value (keys it lacks pad with 0). Raises `ValueError` for no items and the
    first `validate` error when the items cannot be batched together.
    """
    _check_items("collate", items)
    if not items:
        raise ValueError("collate needs at least one item")
    _validate.choice("padding_side", padding_side, ("right", "left"))
    multiple = _validate.optional_count("pad_to_multiple_of", pad_to_multiple_of)
    for error in validate(items):
        if error is not None:
            raise error
    return _collate_valid(
        items, pad_value=pad_value, padding_side=padding_side, pad_to_multiple_of=multiple
    )


def _collate_valid(
    items: Sequence[Any],
    *,
    pad_value: float | int | Mapping[str, float | int],
    padding_side: PaddingSide,
    pad_to_multiple_of: int | None,
) -> Collated:
    """`collate` for items `validate` has passed and arguments already checked."""
    first = items[0]
    pairs = _leaves(first)
    if isinstance(pad_value, Mapping) and not isinstance(first, Mapping):
        raise TypeError(
            f"a pad_value mapping needs dict items, got {type(first).__name__} items; "
            "pass one number"
        )
    if _stacks_alone(items):
        return _collate_lone(first, pairs, pad_value, padding_side)
    paths = [path for path, _ in pairs]
    if isinstance(first, Mapping):
        keys = [path[0] for path in paths]
        columns = [[item[key] for item in items] for key in keys]
    elif isinstance(first, tuple):
        columns = [[item[j] for item in items] for j in range(len(paths))]
    else:
        columns = [list(items)]
    batched: list[Any] = []
    shapes: list[list[_Shape]] = []  # shapes[j][i]: item i's leaf at paths[j]
    padded_shapes: list[_Shape] = []
    any_padding = False
    real = _RealPositions(padding_side)
    for path, leaves in zip(paths, columns, strict=True):
        value = pad_value_for(pad_value, path)
        check_pad_value(value, leaves[0], path)
        column = [_shape(leaf) for leaf in leaves]
        batch, padded, did_pad = _collate_leaf(leaves, column, value, pad_to_multiple_of, real)
        batched.append(batch)
        shapes.append(column)
        padded_shapes.append(padded)
        any_padding = any_padding or did_pad
    item_shapes = tuple(zip(*shapes, strict=True))
    sizes = [[shape[0] if shape else 1 for shape in column] for column in shapes]
    lengths = sizes[0] if len(sizes) == 1 else list(map(max, *sizes))
    padded_length = max(shape[0] if shape else 1 for shape in padded_shapes)
    mask = _mask(lengths, padded_length, real, batched[0]) if any_padding else None
    return Collated(
        data=_assemble(first, paths, batched),
        lengths=lengths,
        mask=mask,
        padded_length=padded_length,
        padding_side=padding_side,
        _paths=tuple(paths),
        _item_shapes=item_shapes,
        _padded_shapes=tuple(padded_shapes),
    )


def _stacks_alone(items: Sequence[Any]) -> bool:
    """Whether the batch is one item, which nothing pads: its leaves are stacked alone,
    without comparing shapes. (The tests turn this off to compare the two ways.)"""
    return len(items) == 1


def _collate_lone(
    item: Any,
    pairs: list[tuple[_Path, Any]],
    pad_value: float | int | Mapping[str, float | int],
    padding_side: PaddingSide,
) -> Collated:
    """`_collate_valid` for one item: each leaf gains a batch axis of 1 (a copy, as for a
    batch of several), nothing is padded, and the pad values are checked all the same."""
    batched: list[Any] = []
    shapes: list[_Shape] = []
    for path, leaf in pairs:
        check_pad_value(pad_value_for(pad_value, path), leaf, path)
        shape = _shape(leaf)
        _check_size(1, shape, leaf)
        batched.append(_stacked([leaf]))
        shapes.append(shape)
    length = max(shape[0] if shape else 1 for shape in shapes)
    paths = [path for path, _ in pairs]
    return Collated(
        data=_assemble(item, paths, batched),
        lengths=[length],
        mask=None,
        padded_length=length,
        padding_side=padding_side,
        _paths=tuple(paths),
        _item_shapes=(tuple(shapes),),
        _padded_shapes=tuple(shapes),
    )


def _assemble(first: Any, paths: list[_Path], batched: list[Any]) -> Any:
    """The batch in the items' structure: `batched[j]` is the leaf at `paths[j]`."""
    if isinstance(first, Mapping):
        return {str(path[0]): batch for path, batch in zip(paths, batched, strict=True)}
    if isinstance(first, tuple):
        return tuple(batched)
    return batched[0]


# -- split ------------------------------------------------------------------------------------


def split(outputs: Any, collated: Collated, *, copy: bool = False) -> list[Any]:
    """One output per collated item: row `i` of every array/tensor in `outputs`.

    `outputs` is an array/tensor with the batch on axis 0, or a dict, tuple or
    list of them (nested as you like); each item gets the same structure back
    (dicts as plain dicts, named tuples rebuilt). `None` stays `None`.

    Un-padding, so that item `i` gets exactly what it would get alone:

    - an output at the same place as an input leaf (the same dict key or tuple
      position, or both lone arrays) whose axes after the batch axis start with
      that leaf's padded shape is cut back to item `i`'s own shape of that leaf
      (so `split(collated.data, collated)` returns the items);
    - otherwise, when padding happened, an output with ndim >= 2 whose axis 1 is
      `collated.padded_length` carries the padded sequence axis and is cut to the
      item's length: its first `lengths[i]` positions for right padding, its last
      for left padding;
    - anything else (pooled outputs such as `(n, hidden)`) is row `i` as it is.

    A pooled output whose axis 1 happens to equal `padded_length` is
    indistinguishable from a sequence output and is cut too. Rows are views into
    `outputs` unless `copy=True` (then a caller holding its row does not keep the
    whole batch alive). An output whose axis 0 is not the number of items raises
    `ValueError`; a value that is not an array, tensor, dict, tuple, list or None
    raises `TypeError`.
    """
    if not isinstance(collated, Collated):
        raise TypeError(
            f"split needs the Collated that collate returned, got {_type_name(collated)}"
        )
    count = len(collated.lengths)
    return _split(outputs, collated, (), count, copy)


def _split(node: Any, collated: Collated, path: _Path, count: int, copy: bool) -> list[Any]:
    if node is None:
        return [None] * count
    if _is_leaf(node) or isinstance(node, np.generic):
        shape = _shape(node)
        if not shape or shape[0] != count:
            got = f"shape {shape}" if shape else "a 0-d value"
            raise ValueError(
                f"{_where(path)} must have the batch on axis 0: expected {count} rows "
                f"(one per item), got {got}"
            )
        rows = [_unpad(node[index, ...], index, collated, path) for index in range(count)]
        if copy:
            rows = [row.clone() if _is_tensor(row) else row.copy() for row in rows]
        return rows
    if isinstance(node, Mapping):
        parts = {
            key: _split(value, collated, (*path, key), count, copy) for key, value in node.items()
        }
        return [{key: part[index] for key, part in parts.items()} for index in range(count)]
    if isinstance(node, (tuple, list)):
        columns = [
            _split(value, collated, (*path, position), count, copy)
            for position, value in enumerate(node)
        ]
        if isinstance(node, list):
            return [[column[index] for column in columns] for index in range(count)]
        if hasattr(node, "_fields"):  # a named tuple
            return [type(node)(*(column[index] for column in columns)) for index in range(count)]
        return [tuple(column[index] for column in columns) for index in range(count)]
    raise TypeError(
        f"{_where(path)} is a {type(node).__name__}; split takes NumPy arrays, torch tensors, "
        "and dicts, tuples or lists of them"
    )


def _where(path: _Path) -> str:
    """How an error names the output at `path`: `outputs['logits'][0]`."""
    return "outputs" + "".join(f"[{part!r}]" for part in path)


def _unpad(row: Any, index: int, collated: Collated, path: _Path) -> Any:
    shape = _shape(row)
    if path in collated._paths:
        j = collated._paths.index(path)
        padded = collated._padded_shapes[j]
        if shape[: len(padded)] == padded:
            own = collated._item_shapes[index][j]
            if own == padded:
                return row
            return row[_region(own, padded, collated.padding_side)]
    size = collated.lengths[index]
    if collated.mask is not None and shape and shape[0] == collated.padded_length != size:
        return row[_region((size,), (collated.padded_length,), collated.padding_side)]
    return row


# -- length -----------------------------------------------------------------------------------


def length(item: Any) -> int:
    """The cost of an item for length-aware batching: its size along axis 0.

    For a dict or tuple, the largest over its leaves (not the number of keys);
    1 for a 0-d array or a plain number; 0 for an empty dict or tuple.
    """
    values: Iterable[Any]
    if type(item) is dict:  # the usual item, a tokenizer's output (every call measures it)
        values = item.values()
    elif _is_leaf(item):
        shape = item.shape
        return int(shape[0]) if len(shape) else 1
    elif isinstance(item, (int, float, complex, np.generic)):
        return 1
    elif isinstance(item, Mapping):
        values = item.values()
    elif isinstance(item, tuple):
        values = item
    else:
        raise TypeError(
            f"cannot measure a {_type_name(item)}: items must be NumPy arrays, torch tensors, "
            "dict[str, array] or tuples of arrays"
        )
    return max(map(length, values), default=0)
