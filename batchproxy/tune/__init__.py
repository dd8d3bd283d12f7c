"""`python -m batchproxy.tune module:factory --sample FILE`: the settings, measured.

The tool measures the model of the proxy that `factory` builds, as it is built (its
executor, its `length`), then runs the real scheduler on the simulation's virtual
clock over a range of loads and settings, and recommends the settings that serve
the most traffic within a p99 target (or the most traffic at all):

- `_sample`: the items to measure with (a file, one per line, or a callable);
- `_measure`: the model time per batch size (and per item length), through the
  proxy and its executor, with warm-up and repeats;
- `_fit`: the cost curve fitted to what was measured;
- `_sweep`: the settings x loads, open loop (Poisson arrivals) and closed loop
  (N callers), each a simulation of a fresh proxy with a model of that cost;
- `_choose`: the recommendation, the knee, and what another slot or replica buys
  (`_analysis` runs these steps from a measurement on);
- `_report`: the Markdown report, its plots (matplotlib, if installed, imported
  when drawing) and the options as Python code.

The library prints nothing: the command line (`__main__`) prints the summary and
the progress bars (on stderr). The functions are importable for scripts and tests.

May import: `_collector`, `_decorator`, `_factory`, `_listeners`, `_option_values`, `_options`,
`_proxy`, `_scheduling`, `_stats`, `simulation`.
"""

from ._analysis import Analysis, analyse
from ._choose import Choice, Extra, Recommendation, rank, recommend
from ._errors import TuneError
from ._fit import CostCurve, fit
from ._measure import Measurement, Point, measure
from ._report import write_report
from ._sample import load_sample
from ._sweep import Load, Outcome, Setting, Simulator, settings_for, sweep

__all__ = [
    "Analysis",
    "Choice",
    "CostCurve",
    "Extra",
    "Load",
    "Measurement",
    "Outcome",
    "Point",
    "Recommendation",
    "Setting",
    "Simulator",
    "TuneError",
    "analyse",
    "fit",
    "load_sample",
    "measure",
    "rank",
    "recommend",
    "settings_for",
    "sweep",
    "write_report",
]
