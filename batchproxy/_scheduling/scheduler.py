"""The dispatch policy: when a batch leaves the queue, and who is in it.

Event-driven, no polling: the scheduler runs only when something happens (an
arrival, a batch finishing, its one timer firing), decides, and goes back to
sleep. Once the queue is empty no timer stays armed: an idle proxy costs no CPU.

A batch leaves, with up to `batch_size` requests, when a batch slot is free
(fewer than `max_concurrent_batches` in flight) and one of these holds:

1. `batch_size` requests are queued (a full batch; with batch keys, of one key:
   which key's batch goes is the `KeyedQueue`'s choice);
2. a slot has just freed while requests were waiting for it (they go at once:
   they have already waited for the model, not for company);
3. the oldest queued request has waited `max_delay_ms`;
4. the `adaptive` window finds waiting no longer pays (below);
5. waiting longer would leave the earliest deadline in the queue less than
   twice the batch's predicted model time (once the cost model has a line);
6. the proxy is draining for `aclose()`.

Arrivals within one event-loop iteration always coalesce: a decision runs in a
callback scheduled once per iteration, after every ready caller has queued. An
arrival to an empty proxy, which goes at once anyway, skips that callback: it
starts the batch task itself, and the task takes its batch when it first runs,
so the model starts one iteration sooner with the same company. A freed slot is
also filled from such a callback, two iterations after its batch ended, so that
callers woken by that batch (withdrawing requests, say) and the calls the loop
was taking in as it ended act first (docs/scheduling.md says why). Except when
the batch answered every caller with a result (so none withdraws anything) and a
full batch is waiting: that batch starts at once, before those callers wake.

The window (rule 3 and 4). Only arrivals that find the proxy busy (something
queued or running) count as evidence that company comes: an arrival to an empty
proxy goes at once, whatever came before, under either window policy. So a lone
request on an idle proxy, and each call of a caller that awaits one call after
another, never waits. For the rest:

- `fixed`: a partial batch leaves once its oldest request has waited
  `max_delay_ms` (the classic size-or-delay rule).
- `adaptive` (the default): it leaves as soon as waiting stops paying, and never
  later than the fixed rule would. The expected gap to the next arrival is the
  larger of the smoothed mean gap between overlapping arrivals (EWMA, weight
  0.2) and the most recent one. It leaves when the next arrival is not expected
  before the window closes (`t + gap >= oldest + max_delay_ms`). While another
  batch runs and the cost model has a line, it leaves once `1/slots` of the
  predicted model time of the batch last sent has passed since it was sent: the
  batches then run staggered, so a slot frees for the next arrivals every
  `model time / slots` rather than all at once. With nothing running it leaves
  once the queue has been quiet for twice the expected gap (the stream paused:
  the stragglers of a burst go at once).

With one batch slot (the default) the window rarely matters: requests that
arrive while the model runs wait for the slot and go when it frees (rule 2).
It decides how partial batches fill free slots when `max_concurrent_batches > 1`.

Length-aware batches (when requests carry a cost, e.g. a sequence length): a
batch still leaves by the rules above (a full token budget counts as full),
but its members are picked from the first `max(4 x batch_size, 64)` queued
requests so that padding is small: the first request in order (below) always
goes, with the requests closest to it in cost. A request that is among the
`batch_size` first (the batch a plain pop would send) and left out is
passed over; once passed over 3 times it goes in the next batch. So no request
waits more than 3 batches longer than in that order (with a token budget, a
request that does not fit goes in the batch after). Forcing it after a single
pass would make every other batch an unsorted one and undo the grouping under
load. With `max_batch_tokens`, members x largest cost stays within the
budget, and an item over the budget goes alone.

Allowed batch sizes without a filler (`cut_to`, from `batch_sizes`): a batch
takes the largest allowed size that the requests it draws from fill (the queue's,
or with batch keys its key's: `Queue.next_live`; the pop sizes it, from the key
it takes it from, chosen as for a full batch), the rest stay queued; one due to
leave at a size not allowed (but full, a full token budget, or draining) waits
for the next allowed size while the missing requests are expected before its
window closes and its deadline rule (`sizes.AllowedSizes.wait_until`). With a
filler the scheduler does nothing special: `_runs.sized.SizedExecutor` pads.

Order: highest priority first; within a priority, small calls before bulk calls
(of more than `bulk_threshold` items), the bulk calls keeping one place in
`BULK_EVERY`; within each, earliest deadline first, then requests without a
deadline in arrival order; with `aging`, an old request climbs levels (see
`_scheduling.queue`). Once a call names a tenant, the queue is a
`FairQueue`: tenants share each batch by weighted fair queuing first, and this
order applies within each tenant; the rules above look at all tenants together.

Why a batch left, as the DEBUG line on the `batchproxy` logger says (one per
batch, with its size and how long its oldest request waited; nothing is logged
at INFO or above on this path, and nothing at all unless DEBUG is on):

- `idle`: it arrived to an idle proxy (or nothing suggested company): at once;
- `full`: `batch_size` requests were queued; `token budget`: their padded cost
  reached `max_batch_tokens`;
- `slot freed`: a batch ended while requests waited for its slot; `window`: the
  oldest request waited `max_delay_ms`;
- `no company in time`, `stagger`, `quiet`: the adaptive window's three rules
  (the next arrival is not expected before the window closes; a slot frees
  next for batches staggered over several slots; the stream paused);
- `deadline`: rule 5 (none before the cost model predicts); `drain`: the proxy is
  closing.

Failure modes handled here: a cancelled or expired request is never sent (the queue
drops requests whose future is done); a decision is never lost (each path that can make
a batch ready, arrival, slot freed, timer, drain, schedules one); the timer is re-armed
only when the decision moves earlier.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from .cost_model import CostModel
from .queue import Queue, Request, RequestQueue

if TYPE_CHECKING:
    from .sizes import AllowedSizes

__all__ = ["Limits", "Scheduler"]

T = TypeVar("T")

logger = logging.getLogger("batchproxy")


@dataclass(frozen=True, slots=True)
class Limits:
    """What a scheduler works within (`Scheduler(limits=...)`, `reconfigure`): made by
    the proxy's runner from its options, its executor and its batch cap."""

    batch_size: int
    """The most requests (the current cap, cut to an allowed size) in one batch."""
    max_delay: float
    """Seconds a batch that is not full may wait for company."""
    slots: int
    """Batches in flight at once (`max_concurrent_batches`, or the executor's capacity)."""
    adaptive: bool
    """Whether the delay window adapts to the arrivals (`adaptive`)."""
    aging: float | None
    """Seconds after which a waiting request gains a priority level (`aging`)."""
    predicts: bool
    """Whether the scheduler predicts when each batch ends (by the cost model): what
    staggers batches over several slots and what `shed_late` needs."""
    bulk_threshold: int | None = None
    """A call of more items than this is a bulk call, whose requests yield to small
    calls' (`bulk_threshold`); None: no call is."""


_EWMA_WEIGHT = 0.2
_QUIET_FACTOR = 2.0  # quiet for this many expected gaps: the stream has paused
_TIME_TOLERANCE = 1e-6  # a timer may fire this early; treat it as on time
_DEADLINE_MARGIN = 2.0  # start a batch this many predicted model times before a deadline
_NO_WAIT = frozenset({"drain", "full", "token budget"})  # a cut batch goes at once


class Scheduler(Generic[T]):
    """Holds the queue and starts batches through `start_batch` when the policy says so."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        limits: Limits,
        start_batch: Callable[[list[Request[T]] | None], None],
        by_cost: bool = False,
        group_by_cost: bool = True,
        max_batch_tokens: int | None = None,
        cost_model: CostModel | None = None,
        cut_to: AllowedSizes | None = None,
        name: str = "proxy",
    ) -> None:
        self.loop = loop
        self.name = name  # the proxy's, in the log lines
        # a plain queue; `_scheduling.placement` changes its shape once calls name tenants or keys
        self.queue: Queue[T] = RequestQueue(limits.aging)
        self.in_flight = 0
        self._limit(limits)
        self._start_batch = start_batch
        self._by_cost = by_cost
        self._group = group_by_cost
        self._budget = max_batch_tokens
        self._cost_model = cost_model or CostModel()
        self._cut_to = cut_to  # `batch_sizes` without a filler: batches leave at those sizes
        self._last_dispatch = -math.inf
        self._last_duration = 0.0  # predicted model time of the batch last sent
        self._running_until: list[float] = []  # predicted ends of the batches in flight
        self._decision_scheduled = False
        self._slot_freed = False
        self._slot_held = False  # the freed slot's decision waits one iteration more
        self._draining = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._last_arrival: float | None = None
        self._last_gap = math.inf  # inf: nothing suggests company is coming
        self._mean_gap = math.inf

    # -- events ------------------------------------------------------------------

    def submit(self, request: Request[T]) -> None:
        """Queue a request (its `enqueued_at` is the arrival time) and schedule a decision,
        or, on an empty proxy, start its batch."""
        now = request.enqueued_at
        last = self._last_arrival
        idle = self.queue.live == 0 and self.in_flight == 0
        if last is None or idle:
            self._last_gap = math.inf  # arrived to an empty proxy: no evidence of company
        else:
            gap = now - last
            self._last_gap = gap
            mean = self._mean_gap
            self._mean_gap = gap if mean == math.inf else mean + _EWMA_WEIGHT * (gap - mean)
        self._last_arrival = now
        self.queue.push(request)
        if idle and not self._decision_scheduled and not self._draining:
            # it goes at once (guarantee 5): start the batch task now; it takes its
            # batch when it first runs, so this iteration's other arrivals join it
            self.in_flight += 1
            self._start_batch(None)
        elif not self._decision_scheduled:  # (inline test: every arrival passes here)
            self._schedule_decision()

    def requeue(self, old: Request[T], new: Request[T]) -> None:
        """`new` takes queued `old`'s place, at its own priority and deadline (a shared
        slot moved up by a caller that joined it: `_dedup`)."""
        self.queue.discard(old)
        self.queue.push(new)
        self._schedule_decision()  # an earlier deadline may move the departure earlier

    def take_reserved(self) -> list[Request[T]]:
        """The batch of a task started by an arrival to an idle proxy: what is queued
        now, in the usual order. Empty (and the slot freed) if every request left."""
        batch = self._take()
        if not batch:
            self.batch_finished()
            return batch
        if self._predicts:
            self._note_dispatch(batch)
        if logger.isEnabledFor(logging.DEBUG):
            self._log_departure(batch, "idle")
        return batch

    def batch_finished(self) -> None:
        """A batch slot is free again: waiting requests go, two loop iterations later
        (at once while draining, so a batch always runs while requests remain). With
        none waiting there is nothing to decide: the next arrival finds the proxy idle."""
        self.in_flight -= 1
        self._trim_running()
        if self._draining:
            self._decide()
        elif self.queue.live:
            self._slot_freed = self._slot_held = True
            self._schedule_decision()

    def batch_finished_early(self) -> bool:
        """A batch's model returned a result for every caller, who are not answered yet.
        If a full batch is waiting, free the slot and send it now, so the model starts
        on it before those callers wake (none of them fails, so none withdraws
        anything). False, with nothing changed, if no full batch waits."""
        if self._draining or not self._full():
            return False
        self.in_flight -= 1
        self._trim_running()
        while self.in_flight < self._max_concurrent and self._full():
            if not self._send("full"):
                break  # (dead requests, counted a moment longer: see `_decide`)
        self._slot_freed = self._slot_held = True  # the rest go as after any batch
        self._schedule_decision()
        return True

    def reconfigure(self, limits: Limits) -> None:
        """New limits and window from the next decision on (running batches are not
        touched); the queue's new `aging` orders the next pops."""
        self._limit(limits)
        self._schedule_decision()  # a smaller batch, a new slot or window may send one now

    def is_bulk(self, items: int) -> bool:
        """Whether a call of `items` items is a bulk call: its requests wait in their
        priority's bulk lane, behind small calls but for their share (see
        `_scheduling.queue`). Intake marks them (`Request.bulk`); the queue ranks them."""
        threshold = self._bulk_threshold
        return threshold is not None and items > threshold

    def _limit(self, limits: Limits) -> None:
        self._bulk_threshold = limits.bulk_threshold
        self._batch_size = limits.batch_size
        self._max_delay = limits.max_delay
        self._max_concurrent = limits.slots
        self._adaptive = limits.adaptive
        # with one slot and no shedding, a batch pays nothing for predicting its end
        self._predicts = limits.predicts
        self.queue.aging = limits.aging

    def drain(self) -> None:
        """From now on every queued request goes as soon as a slot is free."""
        self._draining = True
        self._decide()

    def close(self) -> None:
        """Disarm the timer (nothing waits, the proxy is closed, or its loop is gone)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.queue.live == 0

    # -- the decision ------------------------------------------------------------

    def _schedule_decision(self) -> None:
        if not self._decision_scheduled:
            self._decision_scheduled = True
            self.loop.call_soon(self._decide)

    def _decide(self) -> None:
        if self._slot_held and not self._draining:  # (the module docstring: a freed slot)
            self._slot_held = False
            self.loop.call_soon(self._decide)  # still the one decision scheduled
            return
        self._decision_scheduled = False
        go_now = "drain" if self._draining else "slot freed" if self._slot_freed else None
        self._slot_freed = self._slot_held = False
        queue = self.queue
        while self.in_flight < self._max_concurrent and queue.live:
            why = go_now or self._full_reason()
            if why is None:
                departure = self._departure()
                if departure is None:  # every queued request turned out to be dead
                    break
                when, why = departure
                if when > self.loop.time() + _TIME_TOLERANCE:
                    self._arm_timer(when)
                    return
            if self._cut_to is not None and why not in _NO_WAIT:
                wait = self._size_wait(self._cut_to)
                if wait is not None and wait > self.loop.time() + _TIME_TOLERANCE:
                    self._arm_timer(wait)  # the next allowed size is expected in time
                    return
            if not self._send(why):
                # every queued request turned out to be dead: counted until their
                # callers' callbacks (run next) take them out; a pop that does not
                # retire them (`pop_similar`) would find none again, for ever
                break
        if not queue.live:
            self.close()  # nothing waits: no timer left armed

    def _send(self, why: str) -> bool:
        """Start a batch of the queued requests; False if none was live."""
        batch = self._take()
        if batch:  # empty when every queued request turned out to be dead
            self.in_flight += 1
            if self._predicts:
                self._note_dispatch(batch)
            if logger.isEnabledFor(logging.DEBUG):
                self._log_departure(batch, why)
            self._start_batch(batch)
        return bool(batch)

    def _log_departure(self, batch: list[Request[T]], why: str) -> None:
        waited = self.loop.time() - min(request.enqueued_at for request in batch)
        logger.debug(
            "%s: batch of %d left (%s); its oldest request waited %.2f ms",
            self.name,
            len(batch),
            why,
            waited * 1e3,
        )

    def _full(self) -> bool:
        return self._full_reason() is not None

    def _full_reason(self) -> str | None:
        """Why a batch may leave now by size alone, or None (it is not full)."""
        queue, budget = self.queue, self._budget
        if queue.live < self._batch_size and (budget is None or queue.live_cost < budget):
            return None  # (the cheap test first: no batch can be full)
        return queue.full_reason(self._batch_size, budget)  # keyed: one key's batch must be

    def _take(self) -> list[Request[T]]:
        now = 0.0 if self.queue.aging is None else self.loop.time()  # only aging needs it
        # the largest allowed size the batch's requests fill: the queue sizes it from the
        # requests (the key) it takes it from, chosen for the full limit and budget
        cut = None if self._cut_to is None else self._cut_to.fit
        if not self._by_cost:
            return self.queue.pop_batch(self._batch_size, now, cut=cut)
        return self.queue.pop_similar(
            self._batch_size,
            self._budget,
            max(4 * self._batch_size, 64),
            now=now,
            group=self._group,
            cut=cut,
        )

    def _trim_running(self) -> None:
        running = self._running_until
        while len(running) > self.in_flight:  # which one ended is not known: the soonest
            running.remove(min(running))

    def _note_dispatch(self, batch: list[Request[T]]) -> None:
        """Remember when the batch should end, by the cost model (once it has one)."""
        model = self._cost_model
        if model.line is None:
            return
        units = len(batch) if not self._by_cost else len(batch) * max(r.cost for r in batch)
        now = self.loop.time()
        self._last_dispatch = now
        self._last_duration = duration = model.predict(units) or 0.0
        self._running_until.append(now + duration)

    def expected_finish(self, probe: Request[T]) -> float | None:
        """When `probe`, a new request, would be answered at the soonest, by the cost
        model: the batch slot it needs frees, then the model serves everything ahead of
        it and it in full, unpadded batches spread over every slot. None without a
        cost model."""
        line = self._cost_model.line
        if line is None:
            return None
        fixed, per_unit = line
        now = self.loop.time()
        queue = self.queue
        ahead, cost = queue.count_ahead(probe), probe.cost
        batches = ahead // self._batch_size + 1
        mean_cost = queue.live_cost / queue.live if queue.live else cost
        units = ahead + 1 if not self._by_cost else ahead * mean_cost + cost
        work = (batches * fixed + units * per_unit) / self._max_concurrent
        slot_free = now
        if self.in_flight >= self._max_concurrent and self._running_until:
            slot_free = max(now, min(self._running_until))
        return slot_free + work

    def _departure(self) -> tuple[float, str] | None:
        """When the current partial batch should leave, and by which rule (the window,
        the idle rule, a deadline); None if every queued request turned out to be dead."""
        oldest = self.queue.oldest_enqueued_at()
        if oldest is None:
            return None
        gap = max(self._mean_gap, self._last_gap)
        if gap == math.inf:
            return oldest, "idle"
        departure = self._window_departure(oldest, gap)
        deadline = self.queue.earliest_deadline()
        if deadline != math.inf:
            by_deadline = self._deadline_departure(deadline)
            if by_deadline is not None and by_deadline < departure[0]:
                return by_deadline, "deadline"
        return departure

    def _window_departure(self, oldest: float, gap: float) -> tuple[float, str]:
        """The window's rule: the fixed one, or the first of the adaptive window's."""
        if not self._adaptive:
            return oldest + self._max_delay, "window"
        last = self._last_arrival
        assert last is not None
        expected = oldest + self._max_delay - gap, "no company in time"
        if self.in_flight and self._last_duration:
            slot = self._last_dispatch + self._last_duration / self._max_concurrent, "stagger"
            return min(expected, slot)
        return min(expected, (last + _QUIET_FACTOR * gap, "quiet"))

    def _deadline_departure(self, deadline: float) -> float | None:
        """The latest start that still answers `deadline` (the earliest in the queue):
        twice the cost model's prediction for the batch that would leave before it (a
        margin for the prediction's error and the loop's delays); None without one."""
        queue = self.queue
        size = min(queue.live, self._batch_size)
        units = size if not self._by_cost else size * queue.live_cost / max(1, queue.live)
        took = self._cost_model.predict(units)
        return None if took is None else deadline - _DEADLINE_MARGIN * took

    def _size_wait(self, cut: AllowedSizes) -> float | None:
        """`batch_sizes` without a filler: until when a batch due now waits for the next
        allowed size (see `AllowedSizes.wait_until`); None: it leaves now, cut."""
        queue = self.queue
        oldest = queue.oldest_enqueued_at()
        if oldest is None:
            return None
        deadline = queue.earliest_deadline()
        return cut.wait_until(
            min(queue.next_live(self._batch_size, self._budget), self._batch_size),
            last_arrival=self._last_arrival,
            gap=max(self._mean_gap, self._last_gap),
            closes=oldest + self._max_delay,
            deadline_start=None if deadline == math.inf else self._deadline_departure(deadline),
        )

    def _arm_timer(self, when: float) -> None:
        timer = self._timer
        if timer is not None:
            if not timer.cancelled() and self._timer_at <= when:
                return  # fires no later than needed; it will decide again
            timer.cancel()
        self._timer_at = when
        self._timer = self.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._decide()
