"""Test machinery that ships with the package: fault injection for tests, demos and benchmarks.

Nothing here is part of training. The runtime never imports this package: it calls the
`fault(phase, step=...)` hook it is given, and the worker (elastic) builds that hook from the
environment (`OOBLECK_FAULT`, see `testing/faults.py`).
"""

from oobleck_elastic.testing.faults import PHASES, Fault, FaultInjector, parse_faults

__all__ = ["Fault", "FaultInjector", "PHASES", "parse_faults"]
