"""`batchproxy.tensors`: collate / split round trips, padding, masks, validation, length."""

from __future__ import annotations

import collections
import types
from typing import Any, NamedTuple

import numpy as np
import pytest
from _support import modules_after
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchproxy.tensors import Collated, collate, length, split, validate

DTYPES = ["float32", "float64", "int64", "int32", "bool", "float16"]
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- helpers ----------------------------------------------------------------------------------


def values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.startswith("int"):
        return rng.integers(-50, 50, size=shape).astype(dtype)
    return rng.standard_normal(size=shape).astype(dtype)


def to_numpy(leaf: Any) -> np.ndarray:
    return leaf if isinstance(leaf, np.ndarray) else leaf.numpy()


def leaves_of(item: Any) -> list[tuple[Any, Any]]:
    if isinstance(item, dict):
        return list(item.items())
    if isinstance(item, tuple):
        return list(enumerate(item))
    return [(None, item)]


def assert_same(got: Any, want: Any) -> None:
    """Same structure, library, dtype, shape and values."""
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
    if isinstance(want, (dict, tuple)):
        for (_, g), (_, w) in zip(leaves_of(got), leaves_of(want), strict=True):
            assert_same(g, w)
        return
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    if not isinstance(want, np.ndarray):
        assert got.device == want.device
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def expected_row(leaf: np.ndarray, padded: tuple[int, ...], pad: float, side: str) -> np.ndarray:
    """An independent padding of one leaf, for comparison."""
    row = np.full(padded, pad, dtype=leaf.dtype)
    if side == "right":
        region = tuple(slice(0, size) for size in leaf.shape)
    else:
        pairs = zip(leaf.shape, padded, strict=True)
        region = tuple(slice(full - size, full) for size, full in pairs)
    row[region] = leaf
    return row


# -- round trip (property) --------------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[Any], dict[str, Any]]:
    """Items of one random structure (array, dict or tuple) with random ragged axes."""
    kind = draw(st.sampled_from(["array", "dict", "tuple"]))
    n_leaves = 1 if kind == "array" else draw(st.integers(1, 3))
    n_items = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    specs = []
    for _ in range(n_leaves):
        dtype = draw(st.sampled_from(DTYPES))
        ndim = draw(st.integers(1, 3))
        axes = []
        for _ in range(ndim):
            if draw(st.booleans()):  # ragged: a size per item
                axes.append(draw(st.lists(st.integers(0, 6), min_size=n_items, max_size=n_items)))
            else:
                axes.append([draw(st.integers(1, 4))] * n_items)
        specs.append((dtype, axes))
    keys = ["input_ids", "attention_mask", "labels"][:n_leaves]
    items: list[Any] = []
    for i in range(n_items):
        leaves = [values(rng, tuple(axis[i] for axis in axes), dtype) for dtype, axes in specs]
        if kind == "array":
            items.append(leaves[0])
        elif kind == "dict":
            items.append(dict(zip(keys, leaves, strict=True)))
        else:
            items.append(tuple(leaves))
    pads = {
        key: draw(st.sampled_from([0, 1] if dtype == "bool" else [0, 1, -7]))
        for key, (dtype, _) in zip(keys, specs, strict=True)
    }
    if kind == "dict" and draw(st.booleans()):
        pad_value: Any = pads
    else:
        pad_value = (
            0 if any(dtype == "bool" for dtype, _ in specs) else draw(st.sampled_from([0, -1, 3]))
        )
    options = {
        "pad_value": pad_value,
        "padding_side": draw(st.sampled_from(["right", "left"])),
        "pad_to_multiple_of": draw(st.sampled_from([None, 1, 4])),
    }
    return items, options


def check_round_trip(items: list[Any], options: dict[str, Any]) -> Collated:
    collated = collate(items, **options)
    back = split(collated.data, collated)
    assert len(back) == len(items)
    for got, want in zip(back, items, strict=True):
        assert_same(got, want)
    copies = split(collated.data, collated, copy=True)
    for got, want in zip(copies, items, strict=True):
        assert_same(got, want)
    return collated


def check_padding(items: list[Any], options: dict[str, Any], collated: Collated) -> None:
    """Every row equals an independent padding of its item; mask and lengths agree."""
    side = options["padding_side"]
    pad_value = options["pad_value"]
    multiple = options["pad_to_multiple_of"] or 1
    for key, leaf_batch in leaves_of(collated.data):
        batch = to_numpy(leaf_batch)
        shapes = [to_numpy(dict(leaves_of(item))[key]).shape for item in items]
        for axis, size in enumerate(batch.shape[1:]):
            sizes = {shape[axis] for shape in shapes}
            ragged = len(sizes) > 1
            assert size == (-(-max(sizes) // multiple) * multiple if ragged else max(sizes))
        pad = pad_value.get(key, 0) if isinstance(pad_value, dict) else pad_value
        for i, item in enumerate(items):
            leaf = to_numpy(dict(leaves_of(item))[key])
            np.testing.assert_array_equal(batch[i], expected_row(leaf, batch.shape[1:], pad, side))
    lengths = [max(to_numpy(leaf).shape[0] for _, leaf in leaves_of(item)) for item in items]
    assert collated.lengths == lengths
    assert collated.padding_side == side
    padded_any = any(
        len({tuple(to_numpy(dict(leaves_of(item))[key]).shape) for item in items}) > 1
        for key, _ in leaves_of(items[0])
    )
    if not padded_any:
        assert collated.mask is None
        return
    mask = to_numpy(collated.mask)
    assert mask.dtype == bool
    assert mask.shape == (len(items), collated.padded_length)
    for i, size in enumerate(lengths):
        want = np.zeros(collated.padded_length, dtype=bool)
        if side == "right":
            want[:size] = True
        else:
            want[collated.padded_length - size :] = True
        np.testing.assert_array_equal(mask[i], want)


@SETTINGS
@given(batches())
def test_numpy_round_trip(batch: tuple[list[Any], dict[str, Any]]) -> None:
    items, options = batch
    collated = check_round_trip(items, options)
    check_padding(items, options, collated)


@SETTINGS
@given(batches())
def test_torch_round_trip(batch: tuple[list[Any], dict[str, Any]]) -> None:
    torch = pytest.importorskip("torch")

    def convert(item: Any) -> Any:
        if isinstance(item, dict):
            return {key: torch.from_numpy(leaf) for key, leaf in item.items()}
        if isinstance(item, tuple):
            return tuple(torch.from_numpy(leaf) for leaf in item)
        return torch.from_numpy(item)

    numpy_items, options = batch
    items = [convert(item) for item in numpy_items]
    collated = check_round_trip(items, options)
    check_padding(items, options, collated)
    for _, leaf in leaves_of(collated.data):
        assert isinstance(leaf, torch.Tensor)
    if collated.mask is not None:
        assert isinstance(collated.mask, torch.Tensor)


# -- padding, masks, stacking -----------------------------------------------------------------


def test_same_shape_items_are_stacked_without_mask() -> None:
    items = [np.full((2, 3), i, dtype=np.float32) for i in range(4)]
    collated = collate(items, pad_to_multiple_of=8)
    np.testing.assert_array_equal(collated.data, np.stack(items))
    assert collated.mask is None
    assert collated.lengths == [2, 2, 2, 2]
    assert collated.padded_length == 2


def test_right_padding() -> None:
    items = [np.array([1, 2, 3]), np.array([4])]
    collated = collate(items, pad_value=-1)
    np.testing.assert_array_equal(collated.data, [[1, 2, 3], [4, -1, -1]])
    np.testing.assert_array_equal(collated.mask, [[True, True, True], [True, False, False]])
    assert collated.lengths == [3, 1]
    assert collated.padded_length == 3
    assert collated.data.dtype == np.int64


def test_left_padding() -> None:
    items = [np.array([1, 2, 3]), np.array([4])]
    collated = collate(items, pad_value=-1, padding_side="left")
    np.testing.assert_array_equal(collated.data, [[1, 2, 3], [-1, -1, 4]])
    np.testing.assert_array_equal(collated.mask, [[True, True, True], [False, False, True]])
    assert collated.padding_side == "left"


def test_pad_to_multiple_of_rounds_ragged_axes_only() -> None:
    items = [np.ones((3, 2)), np.ones((5, 2))]
    collated = collate(items, pad_to_multiple_of=4)
    assert collated.data.shape == (2, 8, 2)  # axis 1 is not ragged: left at 2
    assert collated.padded_length == 8
    assert collated.mask.shape == (2, 8)


def test_every_ragged_axis_is_padded() -> None:
    items = [np.ones((2, 3), dtype=np.float32), np.ones((1, 4), dtype=np.float32)]
    collated = collate(items, pad_value=0.5)
    assert collated.data.shape == (2, 2, 4)
    np.testing.assert_array_equal(collated.data[1], [[1, 1, 1, 1], [0.5, 0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(collated.data[0][:, 3], [0.5, 0.5])


def test_dict_pad_values_per_key() -> None:
    items = [
        {
            "input_ids": np.array([5, 6, 7]),
            "attention_mask": np.ones(3, dtype=np.int64),
            "labels": np.array([1, 2, 3]),
        },
        {
            "input_ids": np.array([8]),
            "attention_mask": np.ones(1, dtype=np.int64),
            "labels": np.array([4]),
        },
    ]
    collated = collate(items, pad_value={"input_ids": 9, "labels": -100})
    assert list(collated.data) == ["input_ids", "attention_mask", "labels"]
    np.testing.assert_array_equal(collated.data["input_ids"][1], [8, 9, 9])
    np.testing.assert_array_equal(collated.data["attention_mask"][1], [1, 0, 0])  # missing: 0
    np.testing.assert_array_equal(collated.data["labels"][1], [4, -100, -100])
    np.testing.assert_array_equal(collated.mask, [[True] * 3, [True, False, False]])


def test_dict_length_is_the_longest_leaf() -> None:
    items = [
        {"ids": np.zeros(2), "pixels": np.zeros((4, 3))},
        {"ids": np.zeros(6), "pixels": np.zeros((4, 3))},
    ]
    collated = collate(items)
    assert collated.lengths == [4, 6]
    assert collated.padded_length == 6


def test_tuples() -> None:
    items = [(np.arange(3.0), np.array(1)), (np.arange(2.0), np.array(2))]
    collated = collate(items, padding_side="left")
    assert isinstance(collated.data, tuple)
    np.testing.assert_array_equal(collated.data[0], [[0, 1, 2], [0, 0, 1]])
    np.testing.assert_array_equal(collated.data[1], [1, 2])
    assert_same(split(collated.data, collated)[1], items[1])


def test_zero_length_item() -> None:
    items = [np.zeros(0, dtype=np.int32), np.arange(2, dtype=np.int32)]
    collated = collate(items, padding_side="left")
    np.testing.assert_array_equal(collated.mask, [[False, False], [True, True]])
    assert_same(split(collated.data, collated)[0], items[0])


# -- dtype, device, libraries -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_dtype_kept(dtype: str) -> None:
    rng = np.random.default_rng(0)
    collated = collate([values(rng, (3,), dtype), values(rng, (1,), dtype)])
    assert collated.data.dtype == np.dtype(dtype)
    assert collated.mask.dtype == bool


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32", "bool", "float16"])
def test_torch_dtype_kept(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    tensor_dtype = getattr(torch, dtype)
    items = [torch.zeros(3, 2, dtype=tensor_dtype), torch.ones(1, 2, dtype=tensor_dtype)]
    collated = collate(items)
    assert collated.data.dtype == tensor_dtype
    assert collated.mask.dtype == torch.bool
    assert collate(items[:1]).data.dtype == tensor_dtype


def test_torch_device_kept() -> None:
    """The meta device stands in for an accelerator: nothing may land on the CPU."""
    torch = pytest.importorskip("torch")
    items = [torch.empty(3, 4, device="meta"), torch.empty(5, 4, device="meta")]
    collated = collate(items)
    assert collated.data.device.type == "meta"
    assert collated.mask.device.type == "meta"
    assert collated.data.shape == (2, 5, 4)
    rows = split(torch.empty(2, 5, 8, device="meta"), collated)
    assert [tuple(row.shape) for row in rows] == [(3, 8), (5, 8)]
    stacked = collate([torch.empty(3, device="meta")] * 2)
    assert stacked.data.device.type == "meta"


def test_mixing_numpy_and_torch_raises_type_error() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"item 2: expected a NumPy array.*got a torch tensor"):
        collate([np.zeros(3), np.zeros(2), torch.zeros(3)])
    with pytest.raises(TypeError, match=r"element 0: expected a torch tensor .*got a NumPy array"):
        collate([(torch.zeros(3),), (torch.zeros(3),), (np.zeros(3),)])


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("text", "cannot batch a str"),
        ([1, 2, 3], "cannot batch a list"),
        (3.5, "cannot batch a float"),
        ({"ids": [1, 2]}, "key 'ids' holds a list"),
        ((np.zeros(2), "x"), "element 1 is a str"),
    ],
)
def test_unsupported_type_raises_type_error(item: Any, named: str) -> None:
    with pytest.raises(TypeError, match=named):
        collate([item, item])


def test_collate_argument_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        collate([])
    with pytest.raises(ValueError, match="padding_side"):
        collate([np.zeros(2)], padding_side="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        collate([np.zeros(2)], pad_to_multiple_of=0)
    with pytest.raises(TypeError, match="dict items"):
        collate([np.zeros(2)], pad_value={"a": 1})
    with pytest.raises(ValueError, match="does not fit dtype uint8"):
        collate([np.zeros(2, dtype=np.uint8), np.zeros(1, dtype=np.uint8)], pad_value=-100)
    with pytest.raises(ValueError, match=r"key 'ids'.*int64"):
        collate([{"ids": np.zeros(2, dtype=np.int64)}], pad_value={"ids": 0.5})


# -- split ------------------------------------------------------------------------------------


def test_split_unpads_token_level_outputs_and_keeps_pooled_rows() -> None:
    items = [np.arange(2), np.arange(4), np.arange(3)]
    hidden = 5
    for side in ("right", "left"):
        collated = collate(items, padding_side=side)  # type: ignore[arg-type]
        tokens = np.random.default_rng(0).standard_normal((3, collated.padded_length, hidden))
        pooled = tokens.mean(axis=1)
        parts = split({"last_hidden_state": tokens, "pooled": pooled}, collated)
        for i, part in enumerate(parts):
            own = len(items[i])
            want = tokens[i, :own] if side == "right" else tokens[i, collated.padded_length - own :]
            np.testing.assert_array_equal(part["last_hidden_state"], want)
            np.testing.assert_array_equal(part["pooled"], pooled[i])


def test_split_structures() -> None:
    class Out(NamedTuple):
        logits: np.ndarray
        score: np.ndarray

    collated = collate([np.arange(2), np.arange(3)])
    logits = np.zeros((2, 3, 4))
    score = np.array([0.5, 1.5])
    parts = split([Out(logits, score), None], collated)
    assert isinstance(parts[0], list)
    first, nothing = parts[0]
    assert isinstance(first, Out)
    assert first.logits.shape == (2, 4)
    assert first.score.shape == ()
    assert float(parts[1][0].score) == 1.5
    assert nothing is None


def test_split_is_independent_of_batch_company() -> None:
    """Item 0 gets the same token-level output alone and next to a long neighbour."""
    item = np.array([3, 1, 2])

    def model(batch: np.ndarray) -> np.ndarray:  # position-wise: a function of each token
        return np.stack([batch * 2, batch + 1], axis=-1)

    alone_c = collate([item], padding_side="left")
    alone = split(model(alone_c.data), alone_c)[0]
    together_c = collate([item, np.arange(9)], padding_side="left")
    together = split(model(together_c.data), together_c)[0]
    np.testing.assert_array_equal(alone, together)


def test_split_wrong_batch_size_raises() -> None:
    collated = collate([np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match=r"expected 2 rows.*\(3, 4\)"):
        split(np.zeros((3, 4)), collated)
    with pytest.raises(ValueError, match=r"outputs\['x'\].*expected 2"):
        split({"x": np.zeros(5)}, collated)
    with pytest.raises(ValueError, match="0-d"):
        split(np.float64(1.0), collated)
    with pytest.raises(TypeError, match=r"outputs\[0\] is a float"):
        split([1.0, 2.0], collated)


def test_split_torch_copy_detaches_from_the_batch() -> None:
    torch = pytest.importorskip("torch")
    collated = collate([torch.arange(2), torch.arange(3)])
    outputs = torch.zeros(2, 3, 4)
    views = split(outputs, collated)
    copies = split(outputs, collated, copy=True)
    outputs += 1
    assert float(views[0].sum()) == 8.0
    assert float(copies[0].sum()) == 0.0


# -- validate ---------------------------------------------------------------------------------


def check_only_odd(items: list[Any], odd: int, error: type[Exception], *fragments: str) -> None:
    errors = validate(items)
    for i, found in enumerate(errors):
        if i == odd:
            assert isinstance(found, error), found
            message = str(found)
            assert message.startswith(f"item {odd}: ")
            for fragment in fragments:
                assert fragment in message, (fragment, message)
        else:
            assert found is None, found


def feature(n: int, dtype: Any = np.int64) -> dict[str, np.ndarray]:
    return {"input_ids": np.zeros(n, dtype=dtype), "attention_mask": np.ones(n, dtype=np.int64)}


@pytest.mark.parametrize("odd", [0, 2])
def test_validate_dtype(odd: int) -> None:
    items = [feature(5), feature(6), feature(4)]
    items[odd] = feature(7, np.float32)
    check_only_odd(items, odd, TypeError, "key 'input_ids'", "dtype float32", "int64", "shape (7,)")


@pytest.mark.parametrize("odd", [0, 1])
def test_validate_keys(odd: int) -> None:
    items = [feature(5), feature(6), feature(4)]
    items[odd] = {"input_ids": np.zeros(3, dtype=np.int64), "labels": np.zeros(3)}
    check_only_odd(items, odd, ValueError, "missing 'attention_mask'", "extra 'labels'")


def test_validate_rank() -> None:
    items = [np.zeros(3), np.zeros((3, 2)), np.zeros(5)]
    check_only_odd(items, 1, ValueError, "expected rank 1", "e.g. shape (3,)", "shape (3, 2)")
    dict_items = [feature(5), feature(6), {**feature(2), "attention_mask": np.ones((2, 2))}]
    check_only_odd(
        dict_items, 2, ValueError, "key 'attention_mask'", "got rank 2", "e.g. shape (5,)"
    )


def test_validate_type_and_library() -> None:
    check_only_odd([np.zeros(2), "text", np.zeros(3)], 1, TypeError, "str")
    check_only_odd([{"a": np.zeros(2)}, np.zeros(2), {"a": np.zeros(1)}], 1, TypeError, "dict")
    check_only_odd(
        [(np.zeros(2),), (np.zeros(1),), (np.zeros(1), np.zeros(1))], 2, ValueError, "tuple of 2"
    )
    torch = pytest.importorskip("torch")
    check_only_odd(
        [torch.zeros(2), np.zeros(2), torch.zeros(3)],
        1,
        TypeError,
        "got a NumPy array",
        "expected a torch tensor",
    )
    check_only_odd(
        [
            feature(2),
            {
                "input_ids": torch.zeros(2, dtype=torch.int64),
                "attention_mask": np.ones(2, dtype=np.int64),
            },
            feature(3),
        ],
        1,
        TypeError,
        "key 'input_ids'",
        "torch tensor",
    )


def test_validate_device() -> None:
    torch = pytest.importorskip("torch")
    items = [torch.zeros(2, device="meta"), torch.zeros(3), torch.zeros(4)]
    check_only_odd(items, 0, ValueError, "on meta", "on cpu")


def test_validate_sizes_never_matter() -> None:
    assert validate([np.zeros((1, 9)), np.zeros((4, 2)), np.zeros((0, 3))]) == [None] * 3
    assert validate([]) == []


def test_validate_every_unsupported_item_fails() -> None:
    errors = validate(["a", "b", np.zeros(2), {}])
    assert [type(error) for error in errors] == [TypeError, TypeError, type(None), ValueError]


def test_validate_ties_go_to_the_earliest() -> None:
    errors = validate([np.zeros(2, dtype=np.float32), np.zeros(2, dtype=np.int64)])
    assert errors[0] is None
    assert isinstance(errors[1], TypeError)


# -- length -----------------------------------------------------------------------------------


def test_length() -> None:
    assert length(np.zeros(7)) == 7
    assert length(np.zeros((3, 100))) == 3
    assert length(np.zeros(())) == 1
    assert length(np.float32(2.0)) == 1
    assert length(5) == 1
    many_keys = {f"k{i}": np.zeros(2) for i in range(10)}
    assert length(many_keys) == 2  # the longest leaf, not the number of keys
    assert length({"ids": np.zeros(12), "mask": np.zeros(12), "pixels": np.zeros((3, 5))}) == 12
    assert length((np.zeros(4), np.zeros(9))) == 9
    assert length({}) == length(()) == 0
    nested = ({"ids": np.zeros(3)}, (np.zeros(8), np.zeros(())))
    assert length(nested) == 8
    assert length(collections.UserDict(ids=np.zeros(5))) == 5  # a mapping, not a dict
    assert length(types.MappingProxyType({"ids": np.zeros(4)})) == 4
    assert type(length({"ids": np.zeros(6)})) is int
    with pytest.raises(TypeError, match="str"):
        length("text")
    with pytest.raises(TypeError, match="str"):
        length({"ids": np.zeros(2), "text": "a leaf that is no array"})


def test_length_torch() -> None:
    torch = pytest.importorskip("torch")
    assert length(torch.zeros(6, 2)) == 6
    assert length(torch.tensor(3.0)) == 1
    assert length({"input_ids": torch.zeros(11), "attention_mask": torch.zeros(11)}) == 11


# -- lazy torch -------------------------------------------------------------------------------


def test_import_does_not_import_torch() -> None:
    code = (
        "import numpy as np, batchproxy.tensors as t\n"
        "c = t.collate([np.zeros(2), np.zeros(3)])\n"
        "t.split(c.data, c); t.validate([np.zeros(2), 'x']); t.length({'a': np.zeros(2)})\n"
    )
    assert "torch" not in modules_after(code)
