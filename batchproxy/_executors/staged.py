"""`StagedModel`: a model call in three parts that an executor may overlap.

A batch on an accelerator spends time on the CPU before the device sees it
(collate, pad, start the copy to the device) and after (wait for the
device, copy back, split per caller). Run one batch after another on one
thread and the device idles through both. A `StagedModel` names the parts:

- `prepare(items)`: the CPU work before the model, device copies started;
- `compute(prepared)`: the model, on the thread that owns it;
- `finish(computed)`: wait for the device, then one result per item.

Calling it runs the three in a row, so every executor can run it as a plain
model. An overlapping `WorkerThread` (`overlap=True`) runs `prepare` and
`finish` on a second thread while the model thread computes another batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["StagedModel"]


class StagedModel(ABC):
    """A model callable `finish(compute(prepare(items)))`, its stages separable.

    Stages of one batch run in order; stages of different batches may run at the
    same time on different threads, except `compute`, which runs on the model's
    thread, one batch at a time, in the order the batches were prepared.
    """

    @abstractmethod
    def prepare(self, items: list[Any], /) -> Any:
        """CPU work before the model (collate, pad, start device copies)."""

    @abstractmethod
    def compute(self, prepared: Any, /) -> Any:
        """Run the model on what `prepare` returned (on the model's thread)."""

    @abstractmethod
    def finish(self, computed: Any, /) -> Any:
        """Wait for the device and return one result per item (what a model returns)."""

    def __call__(self, items: list[Any], /) -> Any:
        return self.finish(self.compute(self.prepare(items)))
