"""The failure-trace simulator: a job's throughput under node failures and joins, at any scale,
for our runtime (its real planner and a recovery-cost model fitted to its own measured
recoveries) and for the baselines it is compared with.

    trace.py          traces: the paper's fixed intervals, Poisson preemptions, spot-trace CSVs
    recovery_cost.py  what a recovery costs us; constants fitted from metrics logs
    baselines.py      restart-from-checkpoint, redundant-computation and stock-torchrun models
    engine.py         replays a trace against each system (Note: [simulated time])
    report.py         the table, JSON rows, the plot, the paper's Table 2 beside ours

Pure Python on top of `planning`: no torch, no processes.
"""

from oobleck_elastic.simulation.baselines import Baselines, RedundantBaseline, RestartBaseline, TorchrunBaseline
from oobleck_elastic.simulation.engine import SYSTEMS, SimJob, SystemResult, simulate
from oobleck_elastic.simulation.recovery_cost import RecoveryConstants, default_constants, fit_constants
from oobleck_elastic.simulation.trace import Trace, TraceEvent, fixed_trace, load_csv, parse_duration, poisson_trace

__all__ = ["Baselines", "RecoveryConstants", "RedundantBaseline", "RestartBaseline", "SYSTEMS", "SimJob",
           "SystemResult", "TorchrunBaseline", "Trace", "TraceEvent", "default_constants", "fit_constants",
           "fixed_trace", "load_csv", "parse_duration", "poisson_trace", "simulate"]
