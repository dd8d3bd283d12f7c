"""`load_factory("module:attribute")`: a callable named on a command line.

What `python -m batchproxy.host` serves and `python -m batchproxy.tune` measures:
`module` is imported (from the current directory too, as `python -m` users expect,
when the caller put it on `sys.path`), then the dotted `attribute` is looked up in it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["load_factory"]


def load_factory(spec: str) -> Any:
    """The callable `spec` names (`module:attribute`, dotted attributes allowed).

    Raises `ValueError` for a spec without both parts, `ImportError` for a module
    that does not import, `AttributeError` for a missing attribute and `TypeError`
    for one that is not callable."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"expected module:factory, got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target
