"""The fast paths of `tensors` (validating a batch of alike items without signatures,
collating leaves ragged on axis 0 with one masked copy) give exactly what the full paths
give with them turned off (`full_paths`): the same arrays, dtypes, devices, masks, lengths
and shapes, and the same errors with the same messages, over random batches of every kind."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchproxy import tensors
from batchproxy.tensors import Collated, _items

try:
    import torch
except ImportError:  # the core suite: NumPy alone (the torch cases skip)
    torch = None

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["float32", "float64", "int64", "int32", "bool", "float16", "uint8", "complex64"]
KEYS = ["input_ids", "attention_mask", "labels"]


class Sub(np.ndarray):  # type: ignore[type-arg]
    """A NumPy subclass: valid, but not the exact type the fast path takes."""


if torch is not None:

    class TensorSub(torch.Tensor):  # type: ignore[misc]
        """A torch subclass, likewise."""


class OddKey(str):
    """A str key that shows itself otherwise: the full check compares `str(key)`."""

    __slots__ = ()

    def __str__(self) -> str:
        return "odd-" + super().__str__()


# -- random batches -----------------------------------------------------------------------------


def make_leaf(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, lib: str) -> Any:
    if dtype == "bool":
        values = rng.integers(0, 2, size=shape).astype(bool)
    elif dtype.startswith(("int", "uint")):
        values = rng.integers(0, 50, size=shape).astype(dtype)
    else:
        values = rng.standard_normal(size=shape).astype(dtype)
    return torch.from_numpy(values) if lib == "torch" else values


def is_tensor(value: object) -> bool:
    return torch is not None and isinstance(value, torch.Tensor)


def other_library(leaf: Any) -> Any:
    """The same values in the other library; a leaf whose values cannot cross (a meta
    tensor has none) as it is. Another defect may have come first: a tensor may require
    grad, an array be in the other byte order or a subclass."""
    if not is_tensor(leaf):
        return torch.from_numpy(np.array(leaf, dtype=leaf.dtype.newbyteorder("=")))
    return leaf if leaf.device.type == "meta" else leaf.detach().numpy()


def non_contiguous(leaf: Any) -> Any:
    """The same values, seen through a strided view."""
    if is_tensor(leaf):
        return torch.stack([leaf, leaf], dim=-1)[..., 0] if leaf.ndim else leaf
    return np.stack([leaf, leaf], axis=-1)[..., 0] if leaf.ndim else leaf


def recast(leaf: Any, dtype: str) -> Any:
    if str(leaf.dtype).endswith("complex64") and dtype != "complex64":
        leaf = leaf.real  # (a cast would warn that it drops the imaginary part)
    if is_tensor(leaf):
        return leaf.to(getattr(torch, dtype))
    return leaf.astype(dtype)


ODDITIES = [  # valid, but not what the fast paths take (or not in that order)
    "key order",  # the same keys in another order
    "subclass",  # a NumPy or torch subclass
    "strided",  # a non-contiguous view
    "dtype object",  # an equal NumPy dtype that is another object
    "grad",  # a float torch leaf that requires grad
]
DEFECTS = [
    "dtype",  # a leaf of another dtype
    "rank",  # a leaf with one more axis
    "rank-",  # a leaf with one fewer axis
    "library",  # a leaf from the other library
    "meta",  # a torch leaf on another device
    "byte order",  # a NumPy leaf in the other byte order
    "missing key",
    "extra key",
    "odd key",  # a str subclass key that prints otherwise
    "int key",
    "list value",
    "empty",  # {} or ()
    "kind",  # a tuple for a dict, a dict for an array...
    "not an item",  # a str, a list
]


def leaf_defect(leaf: Any, defect: str, draw: st.DrawFn) -> Any:
    """`leaf` with `defect`, if it is a leaf defect that applies to it."""
    tensor = is_tensor(leaf)
    if defect == "dtype":
        return recast(leaf, draw(st.sampled_from(DTYPES)))
    if defect == "rank":
        return leaf[None]
    if defect == "rank-" and leaf.ndim:
        return leaf[0] if leaf.shape[0] else leaf.sum(0, dtype=leaf.dtype)
    if defect == "library" and torch is not None:
        return other_library(leaf)
    if defect == "meta" and tensor:
        return leaf.to("meta")
    if defect == "subclass":
        return leaf.as_subclass(TensorSub) if tensor else leaf.view(Sub)
    if defect == "strided":
        return non_contiguous(leaf)
    if defect == "dtype object" and not tensor:
        return leaf.astype(np.dtype(leaf.dtype, metadata={"tag": 1}))
    if defect == "byte order" and not tensor and leaf.dtype.itemsize > 1:
        return leaf.astype(leaf.dtype.newbyteorder("S"))
    if defect == "grad" and tensor and leaf.dtype.is_floating_point:
        return leaf.detach().clone().requires_grad_(True)
    if defect == "list value":
        return [1, 2]
    return leaf


@settings(max_examples=5, deadline=None)
@given(st.data())
def test_any_defect_applies_after_any_other(data: st.DataObject) -> None:
    """`batches` may put two defects on one leaf: each applies to what the other left
    (a meta tensor, one that requires grad, an array in the other byte order...), or
    generating a batch would fail, by chance, once in many runs."""
    leaves: list[Any] = [np.arange(6, dtype="float32").reshape(3, 2), np.zeros(2, dtype="int64")]
    if torch is not None:
        leaves += [torch.ones(3, 2), torch.zeros(4, dtype=torch.int64)]
    for leaf in leaves:
        for first in [*ODDITIES, *DEFECTS]:
            once = leaf_defect(leaf, first, data.draw)
            if not (isinstance(once, np.ndarray) or is_tensor(once)):
                continue  # (a list: no leaf left to change)
            for second in [*ODDITIES, *DEFECTS]:
                leaf_defect(once, second, data.draw)


def apply_defect(item: Any, defect: str, draw: st.DrawFn) -> Any:
    """`item` with one defect (or a valid oddity) on one of its leaves, or in its
    structure; an item that is no longer made of leaves is left as it is."""
    if isinstance(item, dict):
        pairs = list(item.items())
    elif isinstance(item, tuple):
        pairs = list(enumerate(item))
    else:
        pairs = [(None, item)]
    if not pairs or not all(isinstance(leaf, np.ndarray) or is_tensor(leaf) for _, leaf in pairs):
        return item
    j = draw(st.integers(0, len(pairs) - 1))
    pairs[j] = (pairs[j][0], leaf_defect(pairs[j][1], defect, draw))
    if isinstance(item, dict):
        if defect == "missing key":
            pairs.pop(j)
        elif defect == "extra key":
            pairs.append(("extra", pairs[j][1]))
        elif defect == "key order":
            pairs.reverse()
        elif defect == "odd key":
            pairs[j] = (OddKey(pairs[j][0]), pairs[j][1])
        elif defect == "int key":
            pairs[j] = (7, pairs[j][1])
    result: Any = dict(pairs) if isinstance(item, dict) else tuple(leaf for _, leaf in pairs)
    if not isinstance(item, (dict, tuple)):
        result = pairs[0][1]
    if defect == "empty":
        return {} if isinstance(item, dict) else () if isinstance(item, tuple) else result
    if defect == "kind":
        if isinstance(result, dict):
            return tuple(result.values())
        if isinstance(result, tuple):
            return dict(zip(KEYS, result, strict=False))
        return (result,)
    if defect == "not an item":
        return draw(st.sampled_from(["text", [1, 2], 3.5]))
    return result


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[Any], dict[str, Any]]:
    """Items of one random structure, NumPy, torch or both, ragged on random axes, some
    with a defect; and random collate options."""
    kind = draw(st.sampled_from(["array", "dict", "tuple"]))
    libraries = draw(st.sampled_from(["numpy", "torch", "mixed"] if torch else ["numpy"]))
    n_leaves = 1 if kind == "array" else draw(st.integers(1, 3))
    n_items = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    specs = []
    for _ in range(n_leaves):
        dtype = draw(st.sampled_from(DTYPES))
        lib = draw(st.sampled_from(["numpy", "torch"])) if libraries == "mixed" else libraries
        axes = []
        for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3]))):
            if draw(st.booleans()):  # ragged: a size per item
                axes.append(draw(st.lists(st.integers(0, 6), min_size=n_items, max_size=n_items)))
            else:
                axes.append([draw(st.integers(0, 4))] * n_items)
        specs.append((dtype, lib, axes))
    items: list[Any] = []
    for i in range(n_items):
        leaves = [
            make_leaf(rng, tuple(axis[i] for axis in axes), dtype, lib)
            for dtype, lib, axes in specs
        ]
        if kind == "array":
            items.append(leaves[0])
        elif kind == "dict":
            items.append(dict(zip(KEYS, leaves, strict=False)))
        else:
            items.append(tuple(leaves))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]))):
        index = draw(st.integers(0, n_items - 1))
        change = draw(st.one_of(st.sampled_from(ODDITIES), st.sampled_from(DEFECTS)))
        items[index] = apply_defect(items[index], change, draw)
    numbers = st.one_of(  # mostly numbers every dtype holds; else any
        st.sampled_from([0, 1, np.int64(1), 1.0]),
        st.sampled_from([0, 3, -7, 2.5, 300, math.nan, -math.inf, True]),
    )
    pad_value: Any = draw(numbers)
    if kind == "dict" and draw(st.booleans()):
        chosen = draw(st.lists(st.sampled_from([*KEYS, "other"]), unique=True))
        pad_value = {key: draw(numbers) for key in chosen}
    options = {
        "pad_value": pad_value,
        "padding_side": draw(st.sampled_from(["right", "left"])),
        "pad_to_multiple_of": draw(st.sampled_from([None, 1, 3, 4])),
    }
    return items, options


# -- comparing outcomes -------------------------------------------------------------------------


def outcome(run: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", run()
    except (TypeError, ValueError) as error:
        return "error", (type(error), str(error))


def assert_same_leaf(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    assert got.dtype == want.dtype
    assert str(got.dtype) == str(want.dtype)
    assert tuple(got.shape) == tuple(want.shape)
    if isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want, strict=True)
        return
    assert got.device == want.device
    assert got.requires_grad == want.requires_grad
    if want.device.type != "meta":
        np.testing.assert_array_equal(got.detach().numpy(), want.detach().numpy(), strict=True)


def assert_same_data(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same_leaf(got[key], want[key])
    elif isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_leaf(g, w)
    else:
        assert_same_leaf(got, want)


def assert_same_collated(got: Collated, want: Collated) -> None:
    assert_same_data(got.data, want.data)
    assert got.lengths == want.lengths
    assert [type(size) for size in got.lengths] == [type(size) for size in want.lengths]
    if want.mask is None:
        assert got.mask is None
    else:
        assert_same_leaf(got.mask, want.mask)
    assert got.padded_length == want.padded_length
    assert got.padding_side == want.padding_side
    assert got._paths == want._paths
    assert [type(path[0]) for path in got._paths if path] == [
        type(path[0]) for path in want._paths if path
    ]
    assert got._item_shapes == want._item_shapes
    assert type(got._item_shapes) is tuple
    assert all(type(shapes) is tuple for shapes in got._item_shapes)
    assert all(type(shape) is tuple for shapes in got._item_shapes for shape in shapes)
    assert got._padded_shapes == want._padded_shapes


def assert_same_outcome(got: tuple[str, Any], want: tuple[str, Any]) -> None:
    assert got[0] == want[0], (got, want)
    if want[0] == "error":
        assert got[1] == want[1]
    elif isinstance(want[1], Collated):
        assert_same_collated(got[1], want[1])
    else:
        assert_errors_same(got[1], want[1])


def assert_errors_same(got: list[Exception | None], want: list[Exception | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        assert str(g) == str(w)


@contextlib.contextmanager
def full_paths() -> Iterator[None]:
    """Validation by signatures and collation item by item, a lone item as any batch, as
    before the fast paths: the three checks that choose them answer no. (Not
    `monkeypatch`: hypothesis runs many examples in one test.)"""
    alike, fits, alone = _items._alike, tensors._fits_one_copy, tensors._stacks_alone
    _items._alike = lambda items: False
    tensors._fits_one_copy = lambda first, tensor, shapes: False
    tensors._stacks_alone = lambda items: False
    try:
        yield
    finally:
        _items._alike, tensors._fits_one_copy, tensors._stacks_alone = alike, fits, alone


def everything(items: list[Any], options: dict[str, Any]) -> dict[str, Any]:
    """What each public and internal entry makes of a batch."""
    return {
        "problems": _items._problems(items),
        "validate": tensors.validate(items),
        "prepared": prepared(_items._problems, tensors._collate_valid, items, options),
        "collate": outcome(lambda: tensors.collate(items, **options)),
    }


def prepared(
    problems: Callable[[list[Any]], list[Exception | None]],
    collate_valid: Callable[..., Collated],
    items: list[Any],
    options: dict[str, Any],
) -> tuple[list[Exception | None], tuple[str, Any] | None]:
    """What `TensorProxy._prepare` makes of a batch: each item's error, and the valid
    items collated (or the error collating them raised)."""
    errors = problems(items)
    valid = [item for item, error in zip(items, errors, strict=True) if error is None]
    if not valid:
        return errors, None
    return errors, outcome(lambda: collate_valid(valid, **options))


def assert_as_before(items: list[Any], options: dict[str, Any]) -> None:
    got = everything(items, options)
    with full_paths():
        want = everything(items, options)
    assert_errors_same(got["problems"], want["problems"])
    assert_errors_same(got["validate"], want["validate"])
    new_errors, new_collated = got["prepared"]
    old_errors, old_collated = want["prepared"]
    assert_errors_same(new_errors, old_errors)
    assert (new_collated is None) == (old_collated is None)
    if new_collated is not None and old_collated is not None:
        assert_same_outcome(new_collated, old_collated)
    assert_same_outcome(got["collate"], want["collate"])


def test_full_paths_are_the_other_paths() -> None:
    """The oracle is not the code under test: with the fast paths off, neither runs."""
    items = [np.ones(3), np.ones(1)]
    assert _items._alike(items)
    assert tensors._fits_one_copy(items[0], False, [(3,), (1,)])
    assert tensors._stacks_alone(items[:1])
    with full_paths():
        assert not _items._alike(items)
        assert not tensors._fits_one_copy(items[0], False, [(3,), (1,)])
        assert not tensors._stacks_alone(items[:1])
    assert _items._alike(items)
    assert tensors._stacks_alone(items[:1])
    assert not tensors._stacks_alone(items)


# -- the property -------------------------------------------------------------------------------


@SETTINGS
@given(batches())
def test_fast_paths_give_what_the_full_paths_gave(batch: tuple[list[Any], dict[str, Any]]) -> None:
    items, options = batch
    assert_as_before(items, options)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("multiple", [None, 8])
def test_tokenizer_batches_as_before(side: str, multiple: int | None) -> None:
    """The usual batch (MiniLM-like token dicts, int64, 5-40 tokens) and its variants."""
    rng = np.random.default_rng(1)
    items = [
        {"input_ids": rng.integers(0, 30_000, n), "attention_mask": np.ones(n, dtype=np.int64)}
        for n in rng.integers(5, 41, 32)
    ]
    options = {"pad_value": {"input_ids": 1}, "padding_side": side, "pad_to_multiple_of": multiple}
    assert_as_before(items, options)
    assert_as_before(items[:1], options)
    hidden = [{"embeds": np.ones((n, 4)), "ids": np.zeros(n)} for n in [3, 0, 7]]
    assert_as_before(hidden, {**options, "pad_value": 0.5})
    pytest.importorskip("torch")
    tensor_items = [{key: torch.from_numpy(leaf) for key, leaf in i.items()} for i in items]
    assert_as_before(tensor_items, options)
    assert_as_before(tensor_items[:1], options)
    tensor_hidden = [{key: torch.from_numpy(leaf) for key, leaf in i.items()} for i in hidden]
    assert_as_before(tensor_hidden, {**options, "pad_value": 0.5})


# -- the fast paths are the ones taken ----------------------------------------------------------


def test_an_alike_batch_is_validated_without_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_signature(item: object) -> Any:
        raise AssertionError("the full check ran")

    items = [{"ids": np.zeros(n, dtype=np.int64), "mask": np.ones((n, 2))} for n in (3, 5, 0)]
    monkeypatch.setattr(_items, "_signature", no_signature)
    assert _items._problems(items) == [None, None, None]
    assert _items._problems([np.zeros(2)]) == [None]
    assert _items._problems([(np.zeros(2), np.ones(())), (np.zeros(5), np.ones(()))]) == [None] * 2
    with pytest.raises(AssertionError, match="full check"):  # another key order: the full one
        _items._problems([*items, {"mask": np.ones((1, 2)), "ids": np.zeros(1, dtype=np.int64)}])
    pytest.importorskip("torch")
    mixed = [{"ids": torch.zeros(n, dtype=torch.int64), "mask": np.ones(n)} for n in (3, 5, 0)]
    assert _items._problems(mixed) == [None, None, None]


def test_ragged_axis_0_is_collated_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """No per-item placement (`_region`) for CPU leaves ragged on axis 0 alone; leaves
    ragged on another axis, or on another device, still take it."""
    calls: list[object] = []
    region = tensors._region

    def counted(*args: Any) -> Any:
        calls.append(args)
        return region(*args)

    monkeypatch.setattr(tensors, "_region", counted)
    tensors.collate([np.ones((3, 2)), np.ones((1, 2))], pad_to_multiple_of=4)
    assert calls == []
    tensors.collate([np.ones((3, 2)), np.ones((3, 1))])
    assert len(calls) == 2
    pytest.importorskip("torch")
    tensors.collate([torch.ones(3, 2), torch.ones(1, 2)], padding_side="left")
    assert len(calls) == 2
    tensors.collate([torch.ones(3, device="meta"), torch.ones(1, device="meta")])
    assert len(calls) == 4


def lone_items() -> list[Any]:
    """One item of each kind, NumPy and (when installed) torch."""
    found: list[Any] = [np.arange(6).reshape(3, 2), (np.ones(4), np.zeros(())), {"ids": np.ones(5)}]
    if torch is not None:
        found += [torch.arange(3), {"ids": torch.ones(5, dtype=torch.int64), "m": torch.ones(5)}]
    return found


def test_a_lone_item_is_stacked_without_comparing_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One item skips the batch's leaf-by-leaf collation, yet its batch is a copy: the
    model writing into it leaves the caller's item as it was."""

    def no_batch(*args: object) -> Any:
        raise AssertionError("the batch's collation ran")

    monkeypatch.setattr(tensors, "_collate_leaf", no_batch)

    def leaves_of(structure: Any) -> list[Any]:
        return [leaf for _, leaf in _items._leaves(structure)]

    for item in lone_items():
        before = [leaf.clone() if is_tensor(leaf) else leaf.copy() for leaf in leaves_of(item)]
        collated = tensors.collate([item], pad_value=3)
        assert [tuple(leaf.shape) for leaf in leaves_of(collated.data)] == [
            (1, *leaf.shape) for leaf in before
        ]
        for leaf in leaves_of(collated.data):
            leaf[...] = 7  # the model writes into its batch
        for leaf, was in zip(leaves_of(item), before, strict=True):
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(was))
    with pytest.raises(AssertionError, match="collation ran"):
        tensors.collate([np.ones(2), np.ones(2)])
    with pytest.raises(ValueError, match="pad_value 300 does not fit dtype uint8"):
        tensors.collate([np.ones(2, dtype=np.uint8)], pad_value=300)  # checked, unused


def test_torch_is_still_never_imported() -> None:
    """The cached tensor type is found only once the user has imported torch."""
    from _support import modules_after

    code = (
        "import numpy as np, batchproxy.tensors as t\n"
        "t.validate([np.zeros(2), np.zeros(3)]); t.collate([np.zeros(2), np.zeros(3)])\n"
        "t.validate([{'a': np.zeros(2)}] * 3)\n"
        "t.collate([(np.zeros((2, 1)),), (np.zeros((1, 1)),)])\n"
    )
    assert "torch" not in modules_after(code)
