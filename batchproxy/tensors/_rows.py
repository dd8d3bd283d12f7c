"""Filler rows on the batch axis of a collated batch, for `TensorProxy(batch_sizes=...)`.

`pad_rows` appends rows of `pad_value` to every array of a `Collated` (and rows of
`False` to its mask) so the model sees an allowed batch size; `first_rows` cuts the
model's outputs back to the real items before `tensors.split`. `lengths` keeps one
entry per real item: the filler rows come after them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import Collated
from ._items import _is_tensor
from ._pad_values import pad_value_for

__all__ = ["first_rows", "pad_rows"]


def pad_rows(collated: Collated, size: int, pad_value: Any) -> Collated:
    """`collated` with its batch axis filled up to `size` rows."""
    extra = size - len(collated.lengths)
    if extra <= 0:
        return collated
    data = collated.data
    if isinstance(data, Mapping):
        data = {
            key: _fill(leaf, extra, pad_value_for(pad_value, (key,))) for key, leaf in data.items()
        }
    elif isinstance(data, tuple):
        data = tuple(_fill(leaf, extra, pad_value) for leaf in data)
    else:
        data = _fill(data, extra, pad_value)
    mask = None if collated.mask is None else _fill(collated.mask, extra, False)
    return dataclasses.replace(collated, data=data, mask=mask)


def first_rows(outputs: Any, count: int) -> Any:
    """The first `count` rows of every array in `outputs` (nested in dicts, tuples and
    lists); anything else as it is, for `split` to judge."""
    if _is_tensor(outputs) or isinstance(outputs, np.ndarray):
        return outputs[:count] if outputs.ndim else outputs
    if isinstance(outputs, Mapping):
        return {key: first_rows(value, count) for key, value in outputs.items()}
    if isinstance(outputs, list):
        return [first_rows(value, count) for value in outputs]
    if isinstance(outputs, tuple):
        parts = [first_rows(value, count) for value in outputs]
        return type(outputs)(*parts) if hasattr(outputs, "_fields") else tuple(parts)
    return outputs


def _fill(leaf: Any, extra: int, value: Any) -> Any:
    """`leaf` with `extra` rows of `value` appended on axis 0 (same dtype and device)."""
    shape = (extra, *leaf.shape[1:])
    if _is_tensor(leaf):
        import torch

        return torch.cat([leaf, leaf.new_full(shape, value)])
    return np.concatenate([leaf, np.full(shape, value, dtype=leaf.dtype)])
