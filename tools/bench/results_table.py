"""The terminal summary: one row per phase x concurrency, the numbers the recipe's README quotes."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def results_table(report: Mapping[str, Any]) -> Table:
    table = Table(title=f"{report['target']['model']} @ {report['target']['base_url']}")
    for header in ("phase", "conc", "decode med", "decode mean", "aggregate", "TTFT med ms",
                   "delivered med", "tokens med", "accept", "mean len", "prefix hit", "errors"):
        table.add_column(header, justify="left" if header == "phase" else "right")
    for phase in report["phases"]:
        for level in phase["levels"]:
            summary = level["summary"]
            spec = level["spec_decode"] or {}
            prefix = level["prefix_cache"] or {}
            ttft = summary["ttft_s"]["median"]
            table.add_row(
                phase["name"], str(level["concurrency"]),
                _num(summary["decode_tok_s"]["median"]), _num(summary["decode_tok_s"]["mean"]),
                _num(level["aggregate_tok_s"]), _num(None if ttft is None else ttft * 1000, "{:.0f}"),
                _num(summary["delivered_tok_s"]["median"]), _num(summary["completion_tokens"]["median"], "{:.0f}"),
                _num(spec.get("acceptance_ratio"), "{:.1%}"), _num(spec.get("mean_acceptance_length"), "{:.2f}"),
                _num(prefix.get("hit_rate"), "{:.0%}"), str(level["errors"]) if level["errors"] else "",
            )
    return table


def mixed_table(mixed: Mapping[str, Any]) -> Table:
    """The mixed phase: what one long cold prompt does to the decode streams and to a short request."""
    table = Table(title=f"mixed: {mixed['streams']} stream(s) while a {mixed['long_prompt_tokens']}-token prompt prefills")
    for name in ("decode tok/s before", "during", "after", "longest gap s", "long TTFT s", "short TTFT s"):
        table.add_column(name, justify="right")
    rates = mixed["decode_tok_s"]
    table.add_row(_num(rates["before"]), _num(rates["during"]), _num(rates["after"]),
                  *(_num(mixed[key], "{:.2f}") for key in ("longest_gap_during_s", "long_ttft_s", "short_ttft_s")))
    return table
