"""`python -m batchproxy.tune module:factory --sample FILE [--p99 50ms]`: the settings to use.

`factory` builds the proxy as it is served (as for `python -m batchproxy.host`: a
callable in an importable module, returning a `Proxy`, a `TensorProxy` or a `@batch`
function, or an awaitable of one). `--sample` is a text file (one item a line,
given as `str`) or `module:callable` returning or yielding the items (called with
the proxy if it takes an argument, e.g. to tokenize with the proxy's tokenizer).

It measures the model's time per batch size (and per item length, for a proxy with
a `length`) on the proxy's own executor, simulates the real scheduler with that cost
over a range of loads and settings, prints the settings that serve the most within
`--p99` (or the most throughput, without it) and what to expect, and writes a report
into `--out` (report.md, options.py, and plots when matplotlib is installed).
It measures with what loading left alive frozen out of the collector's passes, as
`Serving` and the host run by default (a full pass over an unfrozen heap with torch
loaded takes 100-200 ms, an outlier in the measured batches that the service does not
have); `--no-freeze-gc` measures a service that does not freeze.
Exit status 2, with the reason on stderr, for a bad factory or sample, a model that
fails on the sample, or a target no setting meets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast

from .._collector import freezes
from .._factory import load_factory
from ._analysis import Analysis, analyse
from ._errors import TuneError
from ._measure import Measurement, measure
from ._progress import Bar
from ._report import summary, write_report
from ._sample import load_sample

PROG = "python -m batchproxy.tune"
_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "": 1e-3}


def parse_duration(text: str) -> float:
    """`50ms`, `0.2s`, `800us` or `50` (milliseconds) in seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|µs|ms|s|)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise TuneError(f"--p99 {text!r}: expected a duration > 0 such as 50ms, 0.2s or 800us")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _numbers(text: str | None, kind: type[float] | type[int]) -> list[Any] | None:
    if text is None:
        return None
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TuneError(f"expected numbers separated by commas, got {text!r}") from None
    if not values or min(values) <= 0:
        raise TuneError(f"expected numbers > 0 separated by commas, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("factory", help="module:callable returning the proxy to tune")
    parser.add_argument(
        "--sample", required=True, help="a file (one item a line) or module:callable"
    )
    parser.add_argument(
        "--p99", help="the p99 latency target (50ms, 0.2s); default: the most throughput"
    )
    parser.add_argument(
        "--out", default="tune-report", help="the report's folder (default: %(default)s)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="batches kept per shape")
    parser.add_argument("--warmup", type=int, default=2, help="batches left out first per shape")
    parser.add_argument("--sizes", help="batch sizes to measure and try, e.g. 1,2,4,8,16,32")
    parser.add_argument("--max-batch", type=int, help="measure batch sizes up to this")
    parser.add_argument("--slots", help="max_concurrent_batches to try (default: lanes, lanes+1)")
    parser.add_argument(
        "--delays", default="2,5,20", help="max_delay_ms to try (default: %(default)s)"
    )
    parser.add_argument("--windows", default="adaptive", help="adaptive, fixed or both (a,b)")
    parser.add_argument("--requests", type=int, default=2000, help="calls per simulated run")
    parser.add_argument(
        "--paths",
        type=int,
        default=10,
        help="simulated runs behind each figure of what to expect: their median, and the "
        "p99's range (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--freeze-gc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure with what is alive gc.freeze()d once loaded, as a service that "
        "freezes it runs (Serving's and the host's default; default: on)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write no plots")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        analysis = run(args)
        paths = write_report(args.out, analysis, plots=not args.no_plots)
    except TuneError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(summary(analysis))
    print(f"report: {paths[0]} (the options as code: {paths[1]})")


def run(args: argparse.Namespace) -> Analysis:
    """Measure and analyse as the command line's arguments say."""
    target = None if args.p99 is None else parse_duration(args.p99)
    windows = [w.strip() for w in args.windows.split(",") if w.strip()]
    if not windows or any(w not in ("adaptive", "fixed") for w in windows):
        raise TuneError(f"--windows {args.windows!r}: adaptive, fixed or adaptive,fixed")
    if args.requests < 100:
        raise TuneError(f"--requests {args.requests}: at least 100 calls a run")
    if args.paths < 1:
        raise TuneError(f"--paths {args.paths}: at least 1 run")
    sizes = _numbers(args.sizes, int)
    if args.max_batch is not None and args.max_batch < 1:
        raise TuneError(f"--max-batch {args.max_batch}: at least 1")
    sys.path.insert(0, "")  # the current directory, as `python -m` users expect
    factory = _load(args.factory)
    sample = load_sample(args.sample) if Path(args.sample).is_file() else None
    measurement = asyncio.run(_measure(factory, args, sample, sizes))
    return analyse(
        measurement,
        target=target,
        requests=args.requests,
        seed=args.seed,
        paths=args.paths,
        slots=_numbers(args.slots, int),
        delays_ms=_numbers(args.delays, float) or (5.0,),
        windows=cast("list[Literal['adaptive', 'fixed']]", windows),
        progress=Bar("simulating"),
    )


def _load(spec: str) -> Any:
    try:
        return load_factory(spec)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise TuneError(f"cannot load the factory {spec}: {exc}") from exc


async def _measure(
    factory: Any, args: argparse.Namespace, sample: list[Any] | None, sizes: list[int] | None
) -> Measurement:
    try:
        made = factory()
        if inspect.isawaitable(made):
            made = await made
    except Exception as exc:
        raise TuneError(f"the factory {args.factory} failed: {type(exc).__name__}: {exc}") from exc
    try:
        if sample is None:
            sample = load_sample(args.sample, made)
        if sizes is None and args.max_batch is not None:
            from ._measure import proxy_of, sizes_to_measure

            sizes = sizes_to_measure(proxy_of(made).options, args.max_batch)
        # the model and the sample are loaded: what a service freezes
        with freezes.held() if args.freeze_gc else contextlib.nullcontext():
            return await measure(
                made,
                sample,
                sizes=sizes,
                repeats=args.repeats,
                warmup=args.warmup,
                progress=Bar("measuring"),
            )
    finally:
        close = getattr(made, "aclose", None)
        if close is not None:
            await close()


if __name__ == "__main__":
    main()
