"""`TensorProxy[In, Out]`: a `Proxy` whose model method sees one collated, padded batch.

A batch runs as: `tensors.validate(items)`, whose errors describe each item alone
(not its position in the batch): an item that cannot be batched with the others
gets its error as its result (that caller alone fails); the rest are
collated (`tensors.collate`), moved to `device` if one is set, passed to
`_forward`, and its outputs are split back to one per item (`tensors.split`),
un-padded where they carry the padded sequence axis.

A plain `def _forward` runs as a `StagedModel` (prepare: validate, collate, pad,
start the copy to `device`; compute: `_forward`, start the copy back to
`output_device`; finish: wait for the device, split), which a `WorkerThread`
with `overlap` pipelines. Between the stages, CUDA events order the copies and
the model across the threads' streams.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from typing_extensions import Unpack

from . import _validate, tensors
from ._executors.devices import torch_device
from ._executors.staged import StagedModel
from ._option_values import BatchSizes
from ._options import ProxyOptions
from ._proxy import Proxy
from ._runs.callers import narrowed
from ._scheduling.sizes import AllowedSizes
from .tensors import Collated, PaddingSide
from .tensors._items import _problems
from .tensors._rows import first_rows, pad_rows

if TYPE_CHECKING:
    import torch

__all__ = ["TensorProxy"]

In = TypeVar("In")
Out = TypeVar("Out")


class TensorProxy(Proxy[In, Out]):
    """A `Proxy` for arrays, tensors and feature dicts: implement `_forward(batch)`.

    Items are NumPy arrays, torch tensors, `dict[str, array]` feature dicts or
    tuples of these, of varying length along axis 0. Arguments (the rest go to
    `Proxy`: `max_delay_ms`, `offload`, `max_batch_tokens`, ...):

    - `pad_value`: what pads ragged items; one value, or one per dict key (e.g.
      `{"input_ids": 0, "labels": -100}`).
    - `padding_side`: `"right"`, or `"left"` for decoder models that read the
      last position.
    - `pad_to_multiple_of`: round the padded length up to a multiple of this.
    - `device`: a torch device (`"cuda:0"`, `"cpu"`) the collated batch and its
      mask are moved to before `_forward` (a non-blocking copy; a pageable
      tensor is not pinned on the fly, which costs more than it saves). Applies
      to torch data only: NumPy items with a `device` set fail their batch with
      `TypeError`. Outputs stay where `_forward` put them; each caller gets its
      own slice of them. A malformed device
      (`"cuda:zz"`) is a `ValueError` here; a valid one this machine lacks
      (`"cuda:0"` without CUDA) is accepted, and each batch then fails with
      torch's error when it is moved there.
    - `output_device`: where each caller's result is put (`"cpu"`): the batch's
      torch outputs are copied there once (non-blocking, into pinned memory from
      a GPU), then split. `None` (the default) leaves them where `_forward` put
      them: each caller then gets a slice of the device tensor, ready to use (the
      batch's device work has finished when a result is handed out).
    - `length_aware`: form batches of items of similar length, so less padding
      is computed. Either way each item's cost is `tensors.length` (pass
      `length=` to change it), which `max_batch_tokens` and the padding stats use.

    With `batch_sizes=` (static-shape engines) the batch axis is padded with
    `pad_value` rows up to the smallest allowed size (mask `False` on them, no
    entry in `lengths`), and their outputs are dropped before the split;
    `pad_item` is not taken.

    A plain `def _forward` runs on the proxy's worker thread, with validation,
    collation and splitting; an `async def _forward` runs on the event loop
    unless `offload=True`.
    """

    _pads_batch_axis = True  # (batch_sizes: pad_value rows, not a pad_item)

    def __init__(
        self,
        batch_size: int = 64,
        *,
        pad_value: float | Mapping[str, float] = 0,
        padding_side: PaddingSide = "right",
        pad_to_multiple_of: int | None = None,
        device: str | torch.device | None = None,
        output_device: str | torch.device | None = None,
        length_aware: bool = True,
        **options: Unpack[ProxyOptions],
    ) -> None:
        _validate.choice("padding_side", padding_side, ("right", "left"))
        self._pad_value = _pad_value(pad_value)
        self._padding_side: PaddingSide = padding_side
        self._pad_to_multiple_of = _validate.optional_count(
            "pad_to_multiple_of", pad_to_multiple_of
        )
        self._device = torch_device("device", device)
        self._output_device = torch_device("output_device", output_device)
        options.setdefault("length", tensors.length)  # costs for max_batch_tokens and stats
        sizes_given = options.get("batch_sizes")
        if "pad_item" in options or (isinstance(sizes_given, BatchSizes) and sizes_given.pads):
            raise TypeError(
                "TensorProxy pads the batch axis with pad_value rows itself; it takes no pad_item"
            )
        self._group_by_length = _validate.flag("length_aware", length_aware)
        super().__init__(batch_size, **options)
        sizes = self.options.batch_sizes
        self._sizes = None if sizes is None else AllowedSizes(sizes.sizes, pads=True)

    @abstractmethod
    def _forward(self, batch: Collated, /) -> Any:
        """Run the model on one collated batch; return the batched outputs.

        `batch.data` is the padded batch (one array/tensor, a dict or a tuple),
        `batch.mask` the attention mask (`None` when nothing was padded). Return
        an array/tensor (or a dict, tuple or list of them) whose axis 0 is the
        batch; outputs whose axis 1 is `batch.padded_length` are un-padded per
        item. May be `async def` or plain `def`.
        """

    def _inference(
        self, items: list[In], /
    ) -> Awaitable[Sequence[Out | BaseException]] | Sequence[Out | BaseException]:
        result: Awaitable[Sequence[Out | BaseException]] | Sequence[Out | BaseException]
        result = self._model_function()(items)
        return result

    def _model_function(self) -> Callable[[list[In]], Any]:
        """A `StagedModel` for a plain `_forward` (so it runs on the worker thread, and
        pipelines on an overlapping one), else a coroutine function."""
        if inspect.iscoroutinefunction(self._forward):
            return self._run_async
        return _Stages(self)

    async def _run_async(self, items: list[In], /) -> list[Any]:
        batch = self._prepare(items)
        if batch.padded is not None:
            with batch.callers():
                outputs = await self._forward(batch.padded)
            batch.deliver(_move_outputs(outputs, self._output_device))
        return batch.results

    def _prepare(self, items: list[In]) -> _Batch:
        """Validate, collate the valid items and move them to the device."""
        errors = _problems(items)  # validate's errors, without batch positions
        results: list[Any] = list(errors)
        valid = [i for i, error in enumerate(errors) if error is None]
        if not valid:
            return _Batch(results, valid, None)
        collated = tensors._collate_valid(  # validated just above: not again
            [items[i] for i in valid],
            pad_value=self._pad_value,
            padding_side=self._padding_side,
            pad_to_multiple_of=self._pad_to_multiple_of,
        )
        if self._device is not None:
            collated = dataclasses.replace(
                collated,
                data=_move(collated.data, self._device),
                mask=None if collated.mask is None else _move(collated.mask, self._device),
            )
        padded, fillers = collated, 0
        if self._sizes is not None:  # filler rows up to an allowed size
            fillers = self._sizes.cover(len(valid)) - len(valid)
            padded = pad_rows(collated, len(valid) + fillers, self._pad_value)
        return _Batch(results, valid, collated, padded, fillers)


class _Stages(StagedModel):
    """A `TensorProxy` batch with a plain `_forward`, in the three stages of a
    `StagedModel`; the `_Batch` travels from one stage to the next.

    With a CUDA `device` (or outputs on one), an event recorded on the preparing
    thread's stream after the copies is waited for on the model thread's stream
    before `_forward`, and one recorded after the model (and the copy back) is
    waited for by `finish`: the stages may run on different threads and streams.
    """

    __slots__ = ("_proxy",)

    def __init__(self, proxy: TensorProxy[Any, Any]) -> None:
        self._proxy = proxy

    def prepare(self, items: list[Any], /) -> _Batch:
        batch = self._proxy._prepare(items)
        if batch.padded is not None and _on_cuda(self._proxy._device):
            batch.ready = _record_event()
            batch.prepared_on = threading.get_ident()
        return batch

    def compute(self, batch: _Batch, /) -> _Batch:
        if batch.padded is None:
            return batch
        # prepared on this thread (the stages in a row), the copies are already queued
        # ahead of the model on this thread's stream: nothing to wait for
        if batch.ready is not None and batch.prepared_on != threading.get_ident():
            _wait_on_this_stream(batch.ready, batch.padded)
        proxy = self._proxy
        with batch.callers():
            outputs = proxy._forward(batch.padded)
        batch.outputs = _move_outputs(outputs, proxy._output_device)
        if batch.ready is not None or _on_cuda(proxy._output_device):
            batch.done = _record_event()
        return batch

    def finish(self, batch: _Batch, /) -> list[Any]:
        if batch.done is not None:
            batch.done.synchronize()  # the model and the copy back have run
        if batch.padded is not None:
            batch.deliver(batch.outputs)
        return batch.results


@dataclasses.dataclass
class _Batch:
    """One batch in flight: per-item results (errors pre-filled), who was collated, and
    the batch the model sees (with filler rows, for `batch_sizes`)."""

    results: list[Any]
    valid: list[int]
    collated: Collated | None
    padded: Collated | None = None
    fillers: int = 0
    """The filler rows at the end of `padded`'s batch axis (`batch_sizes`)."""
    outputs: Any = None
    """What `_forward` returned (moved to `output_device`), until split."""
    ready: torch.cuda.Event | None = None
    """Recorded after the copies to the device (a CUDA device only)."""
    prepared_on: int | None = None
    """The thread that made the copies (and so the stream they were queued on)."""
    done: torch.cuda.Event | None = None
    """Recorded after the model and the copy back (a CUDA device only)."""

    def callers(self) -> contextlib.AbstractContextManager[None]:
        """While `_forward` runs: `caller_contexts()` gives one context per row of the
        batch axis (the valid items', then an empty one per filler row)."""
        return narrowed(self.valid, fillers=self.fillers)

    def deliver(self, outputs: Any) -> None:
        """Each valid item's part of `outputs`; `split` refuses outputs with a wrong count."""
        assert self.collated is not None
        if self.padded is not self.collated:  # drop the filler rows' outputs
            outputs = first_rows(outputs, len(self.valid))
        parts = tensors.split(outputs, self.collated)
        self.outputs = None  # the callers hold their parts; the batch lets go
        for index, part in zip(self.valid, parts, strict=True):
            self.results[index] = part


def _pad_value(value: Any) -> Any:
    """A number, or a mapping from dict key to number (whether it fits a dtype is checked
    when a batch is padded)."""
    pairs = value.items() if isinstance(value, Mapping) else [(None, value)]
    for key, number in pairs:
        if key is not None and not isinstance(key, str):
            raise TypeError(f"pad_value keys must be str, got {type(key).__name__} {key!r}")
        if isinstance(number, bool) or not isinstance(number, (int, float, np.number, np.bool_)):
            where = "" if key is None else f" for key {key!r}"
            raise TypeError(
                f"pad_value{where} must be a number, got {type(number).__name__} {number!r}"
            )
    return value


def _on_cuda(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"


def _record_event() -> torch.cuda.Event:
    """An event recorded on this thread's current stream."""
    import torch

    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def _wait_on_this_stream(event: torch.cuda.Event, batch: Collated) -> None:
    """Make this thread's stream wait for `event`, and tell the allocator that the
    batch's device tensors (made on another stream) are used on this one too, so their
    memory is not handed out again while the model still reads it."""
    import torch

    stream = torch.cuda.current_stream()
    stream.wait_event(event)
    for tensor in _tensors(batch.data, batch.mask):
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)


def _tensors(*nodes: Any) -> list[torch.Tensor]:
    """The torch tensors in nested dicts, tuples and lists."""
    found: list[torch.Tensor] = []
    _map_leaves(nodes, found.append)
    return found


def _move_outputs(outputs: Any, device: torch.device | None) -> Any:
    """The model's torch outputs on `device` (None: where they are); NumPy outputs are
    on the CPU already and stay as they are."""
    if device is None:
        return outputs
    # from a GPU, a non-blocking copy lands in pinned memory
    return _map_leaves(outputs, lambda tensor: tensor.to(device, non_blocking=True))


PIN_INPUTS = False
"""Whether `_move` copies a pageable CPU tensor into pinned memory before its copy to a
CUDA device. Off: pinning on the fly is one more allocation and host copy, which costs
more than the pageable copy it would speed up (PyTorch's `non_blocking` guide; measured
in `benchmarks/gpu/_lone.py`). An item already in pinned memory is copied without one."""


def _move(data: Any, device: torch.device) -> Any:
    """`data` with every torch tensor on `device` (a non-blocking copy; see PIN_INPUTS)."""
    import torch

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if (
            PIN_INPUTS
            and device.type == "cuda"
            and tensor.device.type == "cpu"
            and torch.cuda.is_available()
        ):
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    def refuse(array: np.ndarray[Any, Any]) -> Any:
        raise TypeError(
            f"device={str(device)!r} applies to torch tensors, but this batch holds NumPy "
            f"arrays; send torch tensors (torch.from_numpy) or leave device unset"
        )

    return _map_leaves(data, move, refuse)


def _map_leaves(
    data: Any,
    tensor: Callable[[torch.Tensor], Any],
    array: Callable[[np.ndarray[Any, Any]], Any] | None = None,
) -> Any:
    """`data` (nested dicts, tuples and lists) with each torch tensor mapped by `tensor`
    and each NumPy array by `array` (None: kept)."""
    import torch

    if isinstance(data, torch.Tensor):
        return tensor(data)
    if isinstance(data, np.ndarray):
        return data if array is None else array(data)
    if isinstance(data, Mapping):
        return {key: _map_leaves(value, tensor, array) for key, value in data.items()}
    if isinstance(data, tuple):
        return tuple(_map_leaves(value, tensor, array) for value in data)
    if isinstance(data, list):
        return [_map_leaves(value, tensor, array) for value in data]
    return data
