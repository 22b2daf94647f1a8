"""Line and branch coverage per source tree, from coverage.py's JSON report (`make unit` prints it).

    python -m tools.coverage_summary build/coverage/coverage.json

coverage's own table gives one figure per file that mixes lines and branches; this prints the two apart for
each tree the Makefile measures (plugins/, roles/, overlay/src/) and for all of them together.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TREES = ("plugins/", "roles/", "overlay/src/")
FIELDS = ("covered_lines", "num_statements", "covered_branches", "num_branches")


def tree_totals(report: dict[str, Any], trees: tuple[str, ...] = TREES) -> dict[str, dict[str, int]]:
    """Summed line and branch counts per tree (file paths as coverage writes them, relative to the root)."""
    totals = {name: dict.fromkeys(FIELDS, 0) for name in (*trees, "all")}
    for path, data in report["files"].items():
        summary = data["summary"]
        for name in [tree for tree in trees if path.startswith(tree)] + ["all"]:
            for field in FIELDS:
                totals[name][field] += summary[field]
    return totals


def percent(covered: int, total: int) -> str:
    return "%5.1f %%" % (100.0 * covered / total) if total else "    - "


def render(totals: dict[str, dict[str, int]]) -> str:
    lines = ["coverage per tree: lines and branches (branch = each way out of an if/while/for/... taken)"]
    for name, counts in totals.items():
        lines.append("  %-13s lines %s %-13s  branches %s %s" % (
            name, percent(counts["covered_lines"], counts["num_statements"]),
            "(%d/%d)" % (counts["covered_lines"], counts["num_statements"]),
            percent(counts["covered_branches"], counts["num_branches"]),
            "(%d/%d)" % (counts["covered_branches"], counts["num_branches"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="coverage.py JSON report (`coverage json -o FILE`)")
    args = parser.parse_args(argv)
    print(render(tree_totals(json.loads(args.report.read_text()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
