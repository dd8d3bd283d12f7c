"""The run kinds that tests/failures/test_combinations.py walks beside `Proxy`, `@batch`
and `@batch_args` (issue 38 item 3): a `GenerationProxy`, a `TensorProxy` and a
`Proxy` on `RayActors`, each drawn with the features it can meet and checked by the
same oracle (tests/_combinations.py).

- "generation": continuous batching. Each sequence streams `("c0", item, None, "")`
  at its first step and `Last(("out", item, None, ""))` at its second, so a stream
  reads like the streaming model's; "bad" gets a `ValueError` in its slot at its
  second step, a step holding "boom" raises, one holding "oom" with others runs out
  of memory. Every step is a model call in the log (its items: the active
  sequences'); with `max_batch_tokens` the oracle also checks each step's budget.
- "tensor": a `TensorProxy` whose items travel as NumPy arrays or torch tensors.
  Item `x` is `CODES[x]` repeated `LENGTHS[x]` times (so batches are ragged and
  padded; a row of `pad_value`, 0, is a filler row: `PAD`); "bad" travels as the
  str "bad", which the call refuses at once (`TypeError`: its length, the cost,
  cannot be measured). The model
  echoes the padded batch with the batch key's code per row; `TensorFront` encodes
  each call's item and decodes its result back to `("out", item, key, "")`, so
  "caller i got result i" is still an equality, and a result un-padded wrongly
  decodes to a `("garbled", ...)` the oracle calls cross-talk.
- "ray": `Proxy(offload=RayActors(...))`, the worker-process model (`answer`) in
  one Ray actor; like `ProcessWorkers`, its model sees no batch key nor contexts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import numpy as np
from _combinations import (
    PAD,
    Call,
    Config,
    Log,
    ModelCall,
    Run,
    answer,
    configs,
    item_length,
    key_option,
)
from hypothesis import strategies as st
from typing_extensions import override

import batchproxy
from batchproxy import Last
from batchproxy.tensors import Collated

MODELS = ("generation", "tensor", "ray")
"""The `Config.model` of the run kinds made here."""

# -- generation ---------------------------------------------------------------------------

TOKENS: dict[Hashable, int] = {"x": 1, "y": 2, "bad": 1, "boom": 1, "oom": 2}
"""An item's `length` for `max_batch_tokens` (the tuple items: 3)."""


def tokens(item: Hashable) -> int:
    return TOKENS.get(item, 3)


def step_elements(log: Log, step: batchproxy.Step[Hashable]) -> tuple[ModelCall, list[Any]]:
    """One step of the generation model: recorded, raised ("boom", "oom") or answered."""
    call = log.record([slot.item for slot in step.active], "", False, arguments=True)
    return call, [slot for slot in step.active]


def step_answer(log: Log, call: ModelCall, slots: Sequence[batchproxy.Slot[Hashable]]) -> list[Any]:
    log.answer(call)  # raises for "boom", and "oom" among others; marks the call done
    elements: list[Any] = []
    for slot in slots:
        if slot.state is None:  # its first step
            slot.state = "c0"
            elements.append(("c0", slot.item, None, ""))
        else:
            [result] = answer([slot.item], None, "")
            elements.append(result if isinstance(result, Exception) else Last(result))
    return elements


class Generation(batchproxy.GenerationProxy[Hashable, Any]):
    """A generation model on the loop."""

    def __init__(self, log: Log, delay: float, **options: Any) -> None:
        super().__init__(**options)
        self.log, self.delay = log, delay

    @override
    async def _step(self, step: batchproxy.Step[Hashable]) -> Sequence[Any]:
        call, slots = step_elements(self.log, step)
        if self.delay:
            await asyncio.sleep(self.delay)
        return step_answer(self.log, call, slots)


class ThreadGeneration(batchproxy.GenerationProxy[Hashable, Any]):
    """The same with a plain `def _step`, on a `WorkerThread`."""

    def __init__(self, log: Log, delay: float, **options: Any) -> None:
        super().__init__(**options)
        self.log, self.delay = log, delay

    @override
    def _step(self, step: batchproxy.Step[Hashable]) -> Sequence[Any]:
        call, slots = step_elements(self.log, step)
        if self.delay:
            time.sleep(self.delay)
        return step_answer(self.log, call, slots)


@st.composite
def generation_configs(draw: st.DrawFn, *, threads: bool = False) -> Config:
    """A `GenerationProxy` takes `batch_size`, `max_queue_size`, `stream_buffer`,
    `max_batch_tokens` with `length`, and `offload`; per call a tenant, a priority, a
    deadline. Not drawn, as it takes none of them: dedup and the cache (a stream is
    not shared), keys (it refuses them: sequences of every key share a step), per-batch
    arguments, caller contexts, `isolate_errors`, `oom_backoff`, `batch_sizes`,
    tenant weights and per-tenant limits, aging, `max_delay_ms` (it never waits for
    company) and `max_concurrent_batches` (one step at a time)."""
    options: dict[str, Any] = {
        "batch_size": draw(st.integers(1, 6)),
        "max_queue_size": draw(st.sampled_from([None, 1, 2, 3, 10])),
        "stream_buffer": draw(st.sampled_from([None, 1, 1024])),
    }
    if draw(st.booleans()):
        options["max_batch_tokens"] = draw(st.integers(1, 6))
        options["length"] = tokens
    offload = threads and draw(st.booleans())  # (a plain `def _step` on a worker thread)
    delay = draw(st.sampled_from([0.0, 0.001, 0.01]))
    return Config("generation", options, False, offload, delay)


GENERATION_CHANGES = st.fixed_dictionaries(
    {},
    optional={
        "batch_size": st.integers(1, 6),
        "max_queue_size": st.none() | st.integers(1, 6),
        "stream_buffer": st.none() | st.integers(1, 4),
        # (not `timeout`: a new default deadline would end calls that asked for none)
    },
)
"""What `configure()` may change on a `GenerationProxy` (it refuses the rest)."""


# -- tensors ------------------------------------------------------------------------------

CODES: dict[Hashable, int] = {"x": 1, "y": 2, "boom": 3, "oom": 4, ("k", "x"): 5, ("k", "y"): 6}
NAMES: dict[int, Hashable] = {code: name for name, code in CODES.items()}
LENGTHS: dict[Hashable, int] = {"x": 1, "y": 3, "boom": 2, "oom": 1, ("k", "x"): 2, ("k", "y"): 4}
KEY_CODES: list[Hashable] = [None, "k", "j"]
"""A batch key, as the model writes it in its output: its index here."""


def encode(name: Hashable, library: str) -> Any:
    """The item `name` as it travels: an array (or tensor), or "bad" as the str."""
    if name == "bad":
        return "bad"
    if library == "torch":
        import torch

        return torch.full((LENGTHS[name],), CODES[name], dtype=torch.int64)
    return np.full(LENGTHS[name], CODES[name], dtype=np.int64)


def values(data: Any) -> np.ndarray[Any, Any]:
    if isinstance(data, np.ndarray):
        return data
    return np.asarray(data.cpu())


def tensor_name(item: Any) -> Hashable:
    """The name of an item as it travels (`dedup`'s key)."""
    if isinstance(item, str):
        return item
    row = values(item)
    return NAMES.get(int(row.max()), PAD) if row.size else PAD


def tensor_key(item: Any) -> Hashable:
    """The `key=` option on an item as it travels: `key_option` of its name."""
    return key_option(tensor_name(item))


def decode(result: Any) -> Any:
    """A caller's result back as `("out", item, key, "")`; a row that is not exactly an
    item's own (wrong length, mixed values) as `("garbled", ...)`."""
    row, key = values(result[0]), int(values(result[1]))
    name = tensor_name(row)
    if name not in CODES or row.tolist() != [CODES[name]] * LENGTHS[name]:
        return ("garbled", row.tolist(), key)
    return ("out", name, KEY_CODES[key], "")


class TensorModel(batchproxy.TensorProxy[Any, Any]):
    """An async `_forward` on the loop (or a `WorkerThread` with `offload=`)."""

    def __init__(self, log: Log, delay: float, **options: Any) -> None:
        super().__init__(**options)
        self.log, self.delay = log, delay

    def begin(self, batch: Collated) -> ModelCall:
        rows = values(batch.data)
        names = [tensor_name(row) for row in rows]
        return self.log.record(names, "", self.options.caller_context)

    def finish(self, call: ModelCall, batch: Collated) -> Any:
        self.log.answer(call)  # raises for "boom", and "oom" among others
        code = KEY_CODES.index(call.key)
        data = batch.data
        if isinstance(data, np.ndarray):
            return data.copy(), np.full(len(data), code)
        import torch

        return data.clone(), torch.full((len(data),), code)

    @override
    async def _forward(self, batch: Collated, /) -> Any:
        call = self.begin(batch)
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.finish(call, batch)


class ThreadTensorModel(TensorModel):
    """A plain `def _forward` (its stages on the proxy's worker thread)."""

    @override
    def _forward(self, batch: Collated, /) -> Any:  # type: ignore[override]
        call = self.begin(batch)
        if self.delay:
            time.sleep(self.delay)
        return self.finish(call, batch)


class TensorFront:
    """What the calls go through for a `TensorProxy`: each item encoded, each result
    decoded (errors as they are)."""

    def __init__(self, proxy: TensorModel, library: str) -> None:
        self.proxy, self.library = proxy, library

    def encode(self, item: Hashable) -> Any:
        return encode(item, self.library)

    async def inference(self, item: Hashable, **call: Any) -> Any:
        return decode(await self.proxy.inference(self.encode(item), **call))

    async def inference_many(self, items: Sequence[Hashable], **call: Any) -> list[Any]:
        results = await self.proxy.inference_many([self.encode(i) for i in items], **call)
        return [r if isinstance(r, BaseException) else decode(r) for r in results]

    def submit(self, item: Hashable, **call: Any) -> concurrent.futures.Future[Any]:
        decoded: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(future: concurrent.futures.Future[Any]) -> None:
            if future.cancelled():
                decoded.cancel()
            elif (error := future.exception()) is not None:
                decoded.set_exception(error)
            else:
                decoded.set_result(decode(future.result()))

        self.proxy.submit(self.encode(item), **call).add_done_callback(done)
        return decoded

    def inference_sync(self, item: Hashable, **call: Any) -> Any:
        return decode(self.proxy.inference_sync(self.encode(item), **call))


def tensor_options(options: dict[str, Any]) -> dict[str, Any]:
    """A plain model's drawn options, for a `TensorProxy`: dedup and the key option by
    the item's name (an array is not hashable; "bad" is a str), the batch axis padded
    with `pad_value` rows rather than a `pad_item` (which it refuses)."""
    options = dict(options)
    # (its lengths are its items' shapes: no `length=`; and its model here never hangs,
    # so no watchdog, which would draw "hang" items it cannot take)
    for name in ("length", "batch_timeout"):
        options.pop(name, None)
    dedup = options.get("dedup")
    if dedup is not None:
        options["dedup"] = batchproxy.Dedup(
            key=tensor_name, cache_size=dedup.cache_size, cache_ttl=dedup.cache_ttl
        )
    if options.get("key") is not None:
        options["key"] = tensor_key
    sizes = options.get("batch_sizes")
    if isinstance(sizes, batchproxy.BatchSizes):
        options["batch_sizes"] = sizes.sizes
    return options


LIBRARIES = ["numpy"] + ["torch"] * (importlib.util.find_spec("torch") is not None)
"""What a `TensorProxy`'s items travel as: torch only where it is installed (the core
suites run without it)."""


@st.composite
def tensor_configs(draw: st.DrawFn, *, threads: bool = False) -> Config:
    """A plain model's configuration (every option of `configs()`), as a `TensorProxy`
    with its own options drawn too. Not drawn: per-batch arguments (`_forward` takes
    the batch alone) and streams; a plain `def _forward` only with threads (it always
    runs on a worker thread, which the virtual clock does not wait for)."""
    base = draw(configs(threads=threads).filter(lambda config: config.model == "plain"))
    kind = {
        "library": draw(st.sampled_from(LIBRARIES)),
        "padding_side": draw(st.sampled_from(["right", "left"])),
        "pad_to_multiple_of": draw(st.sampled_from([None, 4])),
        "length_aware": draw(st.booleans()),
        "forward": draw(st.sampled_from(["async", "def"] if threads else ["async"])),
    }
    return Config(
        "tensor",
        tensor_options(base.options),
        base.keys,
        base.offload,
        base.delay,
        real_time=base.real_time,
        kind_options=kind,
    )


# -- Ray actors ---------------------------------------------------------------------------


def ray_model() -> Callable[[list[Hashable]], list[Any]]:
    """A `RayActors` factory: `answer` in the actor (which sees no batch key)."""
    return lambda items: answer(items, None, "")


@st.composite
def ray_configs(draw: st.DrawFn) -> Config:
    """A worker-process configuration (no keys, no contexts: the model runs in another
    process), on one Ray actor; calls from threads too."""
    base = draw(configs(threads=True, processes=True))
    options = dict(base.options)
    options.pop("batch_timeout", None)  # (its model never hangs: no "hang" items)
    return Config("ray", options, base.keys, base.offload, base.delay, real_time=True)


# -- making them, and what the oracle adds ------------------------------------------------


def make(config: Config, log: Log) -> tuple[batchproxy.Proxy[Hashable, Any], Any]:
    """The proxy of a run kind made here, and what the calls go through."""
    if config.model == "ray":
        from batchproxy.integrations.ray import RayActors

        actors = RayActors(ray_model, 1, num_cpus=0.25, name="combinations")
        proxy = batchproxy.Proxy(offload=actors, name="combo", **config.options)
        return proxy, proxy
    offload = batchproxy.WorkerThread(name="combinations") if config.offload else False
    if config.model == "generation":
        cls = ThreadGeneration if config.offload else Generation
        made = cls(log, config.delay, offload=offload, name="combo", **config.options)
        return made, made
    kind = config.kind_options
    tensor = ThreadTensorModel if kind["forward"] == "def" else TensorModel
    model = tensor(
        log,
        config.delay,
        offload=offload,
        name="combo",
        padding_side=kind["padding_side"],
        pad_to_multiple_of=kind["pad_to_multiple_of"],
        length_aware=kind["length_aware"],
        **config.options,
    )
    return model, TensorFront(model, kind["library"])


def explain(
    config: Config, call: Call, item: Hashable, outcome: Any, counts: dict[str, int]
) -> tuple[bool, str | None]:
    """(whether this kind decides `outcome`, and the problem with it or None); a call
    refused at once is counted in `counts` as "refused" (never accepted)."""
    message = str(outcome)
    # measuring its length (its cost) refuses "bad" at once, and a list holding it
    if config.model == "tensor" and isinstance(outcome, TypeError) and "measure a str" in message:
        counts["refused"] += 1
        return True, None if "bad" in call.items else f"{item!r} refused: {outcome!r}"
    if config.model == "generation" and isinstance(outcome, ValueError):
        budget = config.options.get("max_batch_tokens")
        if "more than max_batch_tokens" in message:  # refused at once
            too_many = budget is not None and tokens(item) > budget
            counts["refused"] += 1
            return True, None if too_many else f"refused: {outcome!r}"
    return False, None


def cost(config: Config) -> Callable[[Hashable], int] | None:
    """An item's cost for a batch's `max_batch_tokens` (members x the largest), by its
    name: a `TensorProxy`'s is its shape (`tensors.length` of what it travels as:
    `LENGTHS` here), a plain model's the drawn `length=` (`item_length`). None for a
    `GenerationProxy`, whose budget is a step's sum of `tokens` (`problems` checks it)."""
    if config.model == "generation":
        return None
    if config.model == "tensor":
        return LENGTHS.__getitem__
    return item_length


def problems(result: Run) -> Iterator[str]:
    """What this kind promises beyond the shared oracle: a generation step holds no more
    tokens than its budget."""
    config = result.config
    budget = config.options.get("max_batch_tokens")
    if config.model == "generation" and budget is not None:
        for number, call in enumerate(result.log.calls):
            if sum(map(tokens, call.items)) > budget:
                yield f"step {number} on {call.items}: more than {budget} tokens"
