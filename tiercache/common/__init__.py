"""The small vocabulary every part shares, and nothing else.

``units`` (named conversions), ``fields`` (the checks every option dataclass
uses: ``FieldError`` and sizes, timeouts, counts), ``plugins`` (a class named by
module path, ``package.module:Class``), ``packaged`` (a data file an installed
distribution ships) and ``breaker`` (the circuit breaker that
transfer lanes and the remote tiers' connections keep).

Imports from: nothing in tiercache.
"""
