"""The decode benchmark (``python -m tools.bench``): stream timing, Prometheus deltas, the result schema,
plot and table.

The CLI (cli.py) is kept apart from the logic so every number the benchmark reports can be recomputed in
unit tests from recorded streams and recorded /metrics texts, without a running engine.
"""
