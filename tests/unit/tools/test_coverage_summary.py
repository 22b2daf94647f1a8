"""tools/coverage_summary.py: per-tree line and branch totals from coverage.py's JSON report."""
from __future__ import annotations

import json
from pathlib import Path

from tools import coverage_summary


def _file(lines: int, of_lines: int, branches: int, of_branches: int) -> dict:
    return {"summary": {"covered_lines": lines, "num_statements": of_lines,
                        "covered_branches": branches, "num_branches": of_branches}}


REPORT = {"files": {
    "plugins/module_utils/a.py": _file(9, 10, 3, 4),
    "plugins/modules/b.py": _file(1, 10, 0, 2),
    "roles/self_heal/files/supervisor.py": _file(0, 24, 0, 4),
    "overlay/src/glm53_overlay/c.py": _file(5, 5, 0, 0),
}}


def test_lines_and_branches_are_summed_per_tree_and_overall():
    totals = coverage_summary.tree_totals(REPORT)
    assert totals["plugins/"] == {"covered_lines": 10, "num_statements": 20, "covered_branches": 3, "num_branches": 6}
    assert totals["roles/"] == {"covered_lines": 0, "num_statements": 24, "covered_branches": 0, "num_branches": 4}
    assert totals["all"] == {"covered_lines": 15, "num_statements": 49, "covered_branches": 3, "num_branches": 10}


def test_a_tree_without_branches_prints_a_dash_not_a_division_by_zero(tmp_path: Path, capsys):
    report = tmp_path / "coverage.json"
    report.write_text(json.dumps(REPORT))
    assert coverage_summary.main([str(report)]) == 0
    out = capsys.readouterr().out
    assert "plugins/      lines  50.0 % (10/20)        branches  50.0 % (3/6)" in out
    assert "overlay/src/  lines 100.0 % (5/5)          branches     -  (0/0)" in out
