"""Reproducible measurements of airflow-pglock next to its floor and its alternatives.

One command runs them all and writes docs/benchmarks.md::

    python3 devtools/dev.py bench            # or: .venv/bin/python -m benchmarks.run

Not part of the test suite (tests/integration/test_benchmarks_smoke.py only runs a tiny
configuration so that the harness cannot rot).
"""
