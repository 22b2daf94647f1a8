"""The metric names a Grafana dashboard's queries read, and a check of them against a live Prometheus.

    python -m tools.monitoring.dashboard_queries DASHBOARD.json --prometheus http://HOST:9090 [--allow-absent NAME ...]

exits 1 naming every metric a panel queries that the Prometheus has no series of (--allow-absent: names a
deployment may lack, e.g. GPU readings in the CPU simulation).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
from pathlib import Path
from typing import Iterable, Iterator

# Parts of an expression that are not metric names: strings, label matchers, ranges/durations, Grafana variables,
# and the label lists of aggregation and vector-matching clauses.
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GRAFANA_VARS = re.compile(r"\$\{[^}]*\}|\$\w+")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                       "offset", "atan2", "inf", "nan", "Inf", "NaN"})


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (identifiers that are not functions, keywords or label names)."""
    text = _GRAFANA_VARS.sub(" ", _STRINGS.sub(" ", expr))
    text = _RANGES.sub(" ", _MATCHERS.sub(" ", text))
    text = _LABEL_LISTS.sub(" ", text)
    names: set[str] = set()
    for match in _IDENT.finditer(text):
        word = match.group(0)
        rest = text[match.end():].lstrip()
        if word in _KEYWORDS or rest.startswith("("):
            continue
        # A number's exponent or unit (1e6, 5m) starts inside a number token.
        if match.start() > 0 and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue
        names.add(word)
    return names


def _panels(panels: Iterable[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_queries(dashboard: dict) -> dict[str, list[str]]:
    """Panel title -> the expressions of its targets."""
    return {panel.get("title", f"panel {panel.get('id')}"): [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
            for panel in _panels(dashboard.get("panels", [])) if panel.get("targets")}


def dashboard_metrics(dashboard: dict) -> dict[str, set[str]]:
    """Metric name -> titles of the panels that query it."""
    used: dict[str, set[str]] = {}
    for title, exprs in dashboard_queries(dashboard).items():
        for expr in exprs:
            for name in metric_names(expr):
                used.setdefault(name, set()).add(title)
    return used


def missing_metrics(dashboard: dict, available: set[str], allow_absent: Iterable[str] = ()) -> dict[str, set[str]]:
    allowed = set(allow_absent)
    return {name: titles for name, titles in dashboard_metrics(dashboard).items()
            if name not in available and name not in allowed}


def prometheus_metric_names(url: str, timeout: float = 10.0) -> set[str]:
    with urllib.request.urlopen(url.rstrip("/") + "/api/v1/label/__name__/values", timeout=timeout) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus answered {body}")
    return set(body["data"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dashboard", type=Path)
    parser.add_argument("--prometheus", required=True, help="base URL of the Prometheus the dashboard reads")
    parser.add_argument("--allow-absent", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    dashboard = json.loads(args.dashboard.read_text())
    available = prometheus_metric_names(args.prometheus)
    used = dashboard_metrics(dashboard)
    missing = missing_metrics(dashboard, available, args.allow_absent)
    for name, titles in sorted(missing.items()):
        print(f"missing: {name} (panels: {', '.join(sorted(titles))})", file=sys.stderr)
    print(f"{len(used) - len(missing)} of {len(used)} dashboard metrics present in {args.prometheus}"
          f"{' (allowed absent: ' + ', '.join(sorted(set(args.allow_absent) & set(used))) + ')' if args.allow_absent else ''}")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
