"""Logic of tests/bench_decode.py: stream timing, Prometheus deltas, the result schema, plot and table.

Kept apart from the CLI so every number the benchmark reports can be recomputed in unit tests from
recorded streams and recorded /metrics texts, without a running engine.
"""
