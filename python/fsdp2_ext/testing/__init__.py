"""Fixtures shared by the tests, the benchmarks and the demo: tiny models and checkpoints.

Nothing here is needed to use the library; it ships so that ``make test`` and ``make bench`` run
from an installed package, and so that a user can reproduce a report with the same fixtures.

May import every floor ([Note: the packages' floors]).
"""
