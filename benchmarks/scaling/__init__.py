"""The sweeps of ``benchmarks/scale.py``: one module per dimension a production server grows along.

Each module names its section (``NAME``), measures it (``run(quick)``: a JSON-able section whose ``rows`` hold
one dimension's sizes, with a reference measured in the same run) and renders it (``table(section)``: markdown
lines for docs/benchmarks.md). Not scripts: ``scale.py`` runs them.
"""
