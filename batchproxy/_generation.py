"""`GenerationProxy`: continuous batching. Sequences join and leave a running batch
at every step, so a new request never waits for the whole batch to finish.

One engine task per busy proxy runs steps while anything is active or queued:
before each step, sequences whose stream ended or whose consumer left are let go,
and queued requests join in the queue's order (priority, then deadline, then
arrival) while there is room (`batch_size` active sequences, the
`max_batch_tokens` budget); the step runs; its elements go to their streams. With nothing active
and nothing queued the engine ends, and the next request starts a new one.

Cancellation, written down: a consumer that leaves (`break`, cancelled, its
deadline) is dropped before the next step; the engine task cancelled (its event
loop ending) fails every open stream with `InferenceError`; a step that raises
fails the streams in it and the engine goes on with an empty batch.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypedDict, TypeVar

from typing_extensions import Unpack

from . import _validate
from ._deprecated import warn_renamed
from ._errors import BatchSizeMismatch
from ._executors.base import Executor
from ._loops.binding import Binding
from ._options import ConfigurableOptions, ProxyOptions, check_keywords
from ._proxy import Proxy
from ._runs.batches import RunKind, Runner
from ._runs.streams import hand_element, let_consumers_read
from ._scheduling.queue import Request

__all__ = ["GenerationProxy", "Slot", "Step"]


In = TypeVar("In")
Out = TypeVar("Out")
T = TypeVar("T")


class Slot(Generic[In]):
    """One sequence in the running batch: the caller's `item`, a `state` the model may
    keep anything in (None at first), and how many `chunks` it has been sent."""

    __slots__ = ("_request", "chunks", "item", "state")

    def __init__(self, request: Request[In]) -> None:
        self.item = request.item
        self.state: Any = None
        self.chunks = 0
        self._request = request

    def __repr__(self) -> str:
        return f"<Slot item={self.item!r} chunks={self.chunks}>"


class Step(Generic[In]):
    """What one step works on.

    - `active`: every sequence in the step, in order: the survivors of the previous
      step in their previous order, then the newcomers;
    - `joined`: the newcomers (the tail of `active`), which need their prefill;
    - `kept`: positions, in the previous step's `active`, of the survivors (so
      `cache = cache[kept]` prunes batched state);
    - `left`: sequences gone since the previous step (ended, or their consumer left).
    """

    __slots__ = ("active", "joined", "kept", "left")

    def __init__(
        self, active: list[Slot[In]], joined: list[Slot[In]], kept: list[int], left: list[Slot[In]]
    ) -> None:
        self.active = active
        self.joined = joined
        self.kept = kept
        self.left = left

    def __repr__(self) -> str:
        return (
            f"<Step active={len(self.active)} joined={len(self.joined)} "
            f"kept={len(self.kept)} left={len(self.left)}>"
        )


StepResult = Sequence[Any]

_CHANGEABLE = frozenset({"batch_size", "max_queue_size", "timeout", "stream_buffer"})


class GenerationOptions(TypedDict, total=False):
    """The keyword arguments of `GenerationProxy(...)` besides `batch_size`, `offload`
    and `name` (see `GenerationProxy`)."""

    max_batch_tokens: int | None
    length: Callable[[Any], int] | None
    max_queue_size: int | None
    timeout: float | None
    stream_buffer: int | None
    # deprecated for one release (a DeprecationWarning names the new spelling)
    max_tokens: int | None  # max_batch_tokens=
    tokens: Callable[[Any], int] | None  # length=


_KEYWORDS = frozenset(GenerationOptions.__annotations__) | {"batch_size", "offload", "name"}


class GenerationProxy(Proxy[In, Out]):
    """Continuous batching for generation: implement `_step(step)`; callers use
    `async for chunk in proxy.stream(item)`.

    `_step` gets a `Step` and returns one element per `step.active`, in order: a
    chunk for that caller, `Last(chunk)` (the chunk, then the end of its stream),
    `END` (the end, no chunk), or an `Exception` instance (that caller's stream
    fails). If it raises, every stream in the step fails with the error and the
    next step starts with no survivors. A plain `def _step` runs on the proxy's
    worker thread, an `async def` on the event loop.

    - `batch_size`: the most active sequences in a step.
    - `max_batch_tokens`: a budget for the sum of `length(item)` over the active
      sequences (say prompt length + max new tokens: the most KV cache a sequence
      can take). A request waits until its tokens fit; one whose tokens alone
      exceed the budget is refused at once with `ValueError`.
    - `length`: an item's tokens; without it, as for `Proxy`, the budget measures
      items with `batchproxy.tensors.length`. Given alone, items are measured (the
      cost `stats` and the queue see) and no budget applies.
      (`max_tokens` and `tokens` are the deprecated names of the two.)
    - `max_queue_size`, `timeout` (for the whole stream), `offload`, `name`,
      `stream_buffer`: as for `Proxy`. Any other keyword is a `TypeError` naming
      the nearest one it takes.
    """

    _model_name = "_step"

    def __init__(
        self,
        batch_size: int = 64,
        *,
        offload: bool | Executor = False,
        name: str | None = None,
        **options: Unpack[GenerationOptions],
    ) -> None:
        if type(self)._step is GenerationProxy._step:
            raise TypeError(f"{type(self).__name__} must implement _step(step)")
        check_keywords(f"{type(self).__name__}()", options, _KEYWORDS)
        max_batch_tokens = _renamed(
            "max_tokens", options.get("max_tokens"), "max_batch_tokens",
            options.get("max_batch_tokens"),
        )  # fmt: skip
        length = _renamed("tokens", options.get("tokens"), "length", options.get("length"))
        self._max_tokens = _validate.optional_count("max_batch_tokens", max_batch_tokens)
        # one step at a time, and never a wait for company; the rest as given
        forwarded: ProxyOptions = {
            "max_delay_ms": 0,
            "max_concurrent_batches": 1,
            "max_batch_tokens": max_batch_tokens,
            "length": length,
        }
        if "max_queue_size" in options:
            forwarded["max_queue_size"] = options["max_queue_size"]
        if "timeout" in options:
            forwarded["timeout"] = options["timeout"]
        if "stream_buffer" in options:
            forwarded["stream_buffer"] = options["stream_buffer"]
        super().__init__(batch_size, offload=offload, name=name, **forwarded)

    def configure(self, **changes: Unpack[ConfigurableOptions]) -> None:
        """Change `batch_size` (the most active sequences, from the next step),
        `max_queue_size`, the default `timeout` or `stream_buffer` while it runs; see
        `Proxy.configure`. A generation proxy runs one step at a time and never
        waits for company, so the other options are refused."""
        refused = sorted(
            name for name, value in changes.items() if name not in _CHANGEABLE and value is not ...
        )
        if refused:
            raise TypeError(
                f"{self.name}: a GenerationProxy takes only batch_size, max_queue_size, "
                f"timeout and stream_buffer, not {', '.join(refused)}"
            )
        super().configure(**changes)

    def _step(self, step: Step[In], /) -> Awaitable[StepResult] | StepResult:
        """Run one step over `step.active`; return one element per active sequence."""
        raise NotImplementedError  # __init__ refuses a subclass without it

    def _model_function(self) -> Callable[[Any], Any]:
        return self._step

    def _run_kind(self, model: Callable[..., Any], offload: object) -> RunKind:
        return RunKind(
            functools.partial(_run_engine, max_tokens=self._max_tokens),
            streams=True,
            admits_itself=True,
        )

    def _cost(self, item: In) -> int:
        cost = super()._cost(item)
        budget = self._max_tokens
        if budget is not None and cost > budget:
            raise ValueError(
                f"{self.name}: this item needs {cost} tokens, more than max_batch_tokens={budget}"
            )
        return cost


def _renamed(old: str, old_value: T | None, new: str, new_value: T | None) -> T | None:
    """A keyword given by its deprecated name `old`: warned about, and used as `new`."""
    if old_value is None:
        return new_value
    warn_renamed(f"GenerationProxy({old}=...)", f"{new}=...")
    if new_value is not None:
        raise TypeError(f"{old} is the old name of {new}: give only {new}")
    return old_value


# -- the engine --------------------------------------------------------------------


async def _run_engine(
    runner: Runner[In],
    binding: Binding[In],
    requests: list[Request[In]] | None,
    *,
    max_tokens: int | None,
) -> None:
    """Run steps while anything is active or queued (the batch slot is the engine's)."""
    claimed = runner.claim(binding, requests)
    if claimed is None:
        return
    engine = _Engine(runner, binding, claimed[0], max_tokens)
    binding.members[claimed[1]] = engine.open_requests  # its callers change at every step
    try:
        await engine.run()
    except asyncio.CancelledError as exc:  # from outside: the event loop is ending
        runner.settlement.fail(engine.open_requests(), runner.cancelled_batch_error(exc))
        raise
    finally:
        if binding.serving:
            binding.scheduler.batch_finished()
        runner.end_task(binding, claimed[1])


class _Engine(Generic[In]):
    """The steps of one busy spell of a `GenerationProxy`."""

    def __init__(
        self,
        runner: Runner[In],
        binding: Binding[In],
        first: list[Request[In]],
        max_tokens: int | None,
    ) -> None:
        self.runner = runner
        self.binding = binding
        self.max_tokens = max_tokens
        self.waiting = list(first)  # taken from the queue by the scheduler: join first
        self.active: list[Slot[In]] = []
        self.used = 0  # tokens held by the active sequences

    def open_requests(self) -> list[Request[In]]:
        return [slot._request for slot in self.active] + self.waiting

    async def run(self) -> None:
        loop = self.binding.loop
        left: list[Slot[In]] = []
        while True:
            kept = [i for i, slot in enumerate(self.active) if not slot._request.future.done()]
            survivors = [self.active[i] for i in kept]
            left += [slot for slot in self.active if slot._request.future.done()]
            self.used = sum(slot._request.cost for slot in survivors)
            joined = self._admit(len(survivors), loop.time())
            self.active = survivors + joined
            if not self.active:
                return
            step = Step(self.active, joined, kept, left)
            left = []
            await let_consumers_read(slot._request for slot in survivors)
            elements = await self._run_step(step)
            if elements is None:  # the step failed, and every stream in it
                left, self.active = list(self.active), []
                continue
            now = loop.time()
            for slot, element in zip(self.active, elements, strict=True):
                if not slot._request.future.done() and hand_element(
                    self.runner, slot._request, element, now
                ):
                    slot.chunks += 1

    def _admit(self, active: int, now: float) -> list[Slot[In]]:
        """Newcomers, in queue order, while there is room; the rest keep waiting."""
        queue = self.binding.scheduler.queue
        joined: list[Slot[In]] = []
        budget = self.max_tokens
        waiting = [r for r in self.waiting if not r.future.done()]
        while active + len(joined) < self.runner.options.batch_size:
            request = waiting[0] if waiting else queue.peek(now)
            if request is None:
                break
            if budget is not None and self.used + request.cost > budget:
                break  # in order: it waits for room rather than being overtaken
            if waiting:
                waiting.pop(0)
            else:
                queue.take([request])
            self.used += request.cost
            joined.append(Slot(request))
        self.waiting = waiting
        return joined

    async def _run_step(self, step: Step[In]) -> Sequence[Any] | None:
        """Run the model's step; its elements, or None if it failed (its streams too)."""
        runner = self.runner
        loop = self.binding.loop
        started = loop.time()
        # a step counts as a batch of its active sequences; the queue waits are those
        # of the newcomers (listeners hear `batch_started` with them)
        runner.events.batch_started(
            len(step.active), [started - s._request.enqueued_at for s in step.joined]
        )
        error: BaseException | None = None
        elements: Sequence[Any] | None = None
        try:
            results = await runner.executor.run(runner.model, step)  # type: ignore[arg-type]
            elements = runner.result_sequence(results)
            if len(elements) != len(step.active):
                error = BatchSizeMismatch(runner.name, len(step.active), len(elements))
        except BaseException as exc:
            error = runner.model_failure(exc, self.binding, None)  # (no watchdog on steps)
            if error is None:  # the event loop is ending: so does the step
                raise
        runner.events.batch_finished(len(step.active), loop.time() - started, error)
        if error is not None:  # counted, its streams failed, listeners told: as for a batch
            runner.batch_failed([slot._request for slot in step.active], error)
            return None
        return elements
