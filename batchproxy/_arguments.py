"""Several arguments per call: how a batch function's parameters split, and how the
model is called with them (`@batch_args`, and `Proxy` subclasses whose `_inference`
takes more than its items: `Proxy.with_args`).

The *item parameters* get one list each: a call gives one value for each (with
several, its item is the tuple of their values). The *per-batch parameters* are
not batchable: a call's values for them, by name with the defaults filled in, are
its batch key (`ArgumentsKey`), so calls are batched only with calls of equal
values, and the model gets them once per batch, by name (read back with
`batch_key()`, on the loop or the proxy's worker thread).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable
from typing import Any

from ._runs.keys import batch_key

__all__ = [
    "Arguments",
    "ArgumentsKey",
    "call_with_arguments",
    "model_arguments",
    "refuse_key",
]

PER_CALL = ("timeout", "priority", "tenant")  # (a hint when a call passes one of these)


class ArgumentsKey(tuple[tuple[str, Any], ...]):
    """A batch key made of per-batch arguments: `((name, value), ...)`."""

    __slots__ = ()


class Arguments:
    """How `fn`'s parameters split: `count` item parameters, then `rest` per batch."""

    __slots__ = ("count", "name", "rest")

    def __init__(self, name: str, count: int, rest: inspect.Signature) -> None:
        self.name = name  # how errors name the function
        self.count = count
        self.rest = rest

    @classmethod
    def of(cls, fn: Callable[..., Any], *, skip: int = 0, keyword_only: bool = False) -> Arguments:
        """`fn`'s split, past its first `skip` parameters (`self`): the positional-only
        ones (at least the first) are the items'; per batch are the others, or, with
        `keyword_only`, its keyword-only ones (the others are then not taken)."""
        parameters = list(inspect.signature(fn).parameters.values())[skip:]
        count = sum(p.kind is p.POSITIONAL_ONLY for p in parameters) or 1
        rest = parameters[count:]
        if keyword_only:
            rest = [p for p in rest if p.kind is p.KEYWORD_ONLY]
        return cls(getattr(fn, "__qualname__", repr(fn)), count, inspect.Signature(rest))

    @property
    def more_than_items(self) -> bool:
        """Whether the function takes more than one list of items."""
        return self.count > 1 or bool(self.rest.parameters)

    def item(self, item: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        """A call's item (with several item parameters, the tuple of their values from
        `item` and the first of `args`) and its arguments after it."""
        count = self.count
        if count == 1:
            return item, args
        if len(args) < count - 1:
            raise TypeError(f"{self.name}() takes {count} item arguments, got {len(args) + 1}")
        return (item, *args[: count - 1]), args[count - 1 :]

    def check_item(self, item: Any) -> None:
        """With several item parameters, an item must be the tuple of their values."""
        if self.count > 1 and not (isinstance(item, tuple) and len(item) == self.count):
            raise TypeError(
                f"{self.name}() takes {self.count} item arguments: an item must be a tuple "
                f"of {self.count} values, got {item!r}"
            )

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ArgumentsKey:
        """The per-batch arguments by name, defaults filled in: the call's batch key. A
        `TypeError` for arguments the function does not take, or unhashable ones."""
        try:
            bound = self.rest.bind(*args, **kwargs)
        except TypeError as exc:
            extra = ", ".join(name for name in kwargs if name in PER_CALL)
            hint = (
                f" (per-call keywords go through .with_call_options({extra}=...))" if extra else ""
            )
            raise TypeError(f"{self.name}(): {exc}{hint}") from None
        bound.apply_defaults()
        for name, value in bound.arguments.items():
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"{self.name}(): argument {name!r} must be hashable (it is the batch "
                    f"key), got {type(value).__name__}"
                ) from None
        return ArgumentsKey(bound.arguments.items())


def call_with_arguments(fn: Callable[..., Any], count: int) -> Callable[..., Any]:
    """`fn` called with (self and) a list per item parameter (`count` of them), and the
    batch's key as its other arguments (async if `fn` is: a plain `def` runs on a worker
    thread)."""

    def arguments(head: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        *before, items = head
        columns = (
            (items,) if count == 1 else tuple(list(column) for column in zip(*items, strict=True))
        )
        return (*before, *columns), dict(batch_key() or ())  # type: ignore[call-overload]

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def model(*head: Any) -> Any:
            args, kwargs = arguments(head)
            return await fn(*args, **kwargs)

        return model

    @functools.wraps(fn)
    def plain(*head: Any) -> Any:
        args, kwargs = arguments(head)
        return fn(*args, **kwargs)

    return plain


def refuse_key(name: str, key: Hashable) -> None:
    """A proxy whose model takes per-batch arguments: a call's batch key must be those."""
    if key is not None and type(key) is not ArgumentsKey:
        raise TypeError(
            f"{name}: its _inference takes per-batch arguments, which are its batch key: "
            f"call proxy.with_args(...).inference(item) rather than passing key="
        )


def model_arguments(cls: type, name: str, has_key_option: bool) -> Arguments | None:
    """How a `Proxy` subclass's `_inference` takes its arguments: None when it takes its
    items only (the usual case), else its split (item parameters: the positional-only
    ones; per batch: the keyword-only ones). Its batch key is then its arguments, so a
    `key` option is refused; so is a generator (a stream's steps take no arguments)."""
    fn = cls._inference  # type: ignore[attr-defined]
    arguments = Arguments.of(fn, skip=1, keyword_only=True)
    if not arguments.more_than_items:
        return None
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"{name}: a streaming _inference takes its items only")
    if has_key_option:
        raise TypeError(
            f"{name}: its _inference takes per-batch arguments, which are its batch key: "
            f"it takes no key= option"
        )
    return arguments
