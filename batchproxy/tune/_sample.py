"""The items to measure with: a text file (one item a line) or a callable yielding them.

`--sample FILE` reads the file's non-empty lines as `str` items; `--sample
module:callable` calls the callable (with the proxy, if it takes an argument: a
`TensorProxy` sample can tokenize with the proxy's tokenizer) and takes what it
returns or yields, up to `limit` items. The callable is found as the host finds a
factory (`_factory.load_factory`).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._factory import load_factory
from ._errors import TuneError

__all__ = ["load_sample"]

LIMIT = 10_000


def load_sample(spec: str, proxy: object = None, *, limit: int = LIMIT) -> list[Any]:
    """The sample `spec` names: a file's non-empty lines, or what `module:callable` yields
    (called with `proxy` if it takes one argument); at most `limit` items, at least one."""
    path = Path(spec)
    if path.is_file():
        with path.open(encoding="utf-8") as lines:
            items: list[Any] = [
                line
                for line in (raw.rstrip("\r\n") for raw in itertools.islice(lines, limit))
                if line.strip()
            ]
    elif ":" in spec and not path.exists():
        source = _callable(spec)
        produced = source(proxy) if _takes_an_argument(source) else source()
        if not isinstance(produced, Iterable):
            raise TuneError(f"--sample {spec}: returned {type(produced).__name__}, not items")
        items = list(itertools.islice(produced, limit))
    else:
        raise TuneError(f"--sample {spec!r}: no such file, and not a module:callable")
    if not items:
        raise TuneError(f"--sample {spec!r} is empty: give at least one item to measure with")
    return items


def _callable(spec: str) -> Any:
    try:
        return load_factory(spec)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise TuneError(f"--sample {spec}: {exc}") from exc


def _takes_an_argument(source: Any) -> bool:
    try:
        parameters = inspect.signature(source).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind in positional and p.default is p.empty for p in parameters)
