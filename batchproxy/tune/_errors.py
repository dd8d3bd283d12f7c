"""`TuneError`: what the tool cannot do, said in words (the command line prints it)."""

from __future__ import annotations

__all__ = ["TuneError"]


class TuneError(Exception):
    """A bad factory or sample, a model that fails on the sample, or a target no
    setting meets; the message says which and what to do."""
