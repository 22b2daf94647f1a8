"""The settings table of docs/prefill.md, from the JSON reports of a prefill sweep.

    python -m tools.bench.prefill_table docs/prefill/sweep   # one subfolder of bench-*.json per setting

Each row: the setting (the folder name), then median [min-max] over its runs of the mixed phase's numbers.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

COLUMNS = (
    ("decode tok/s before", lambda m: m["decode_tok_s"]["before"], "{:.0f}"),
    ("during", lambda m: m["decode_tok_s"]["during"], "{:.1f}"),
    ("after", lambda m: m["decode_tok_s"]["after"], "{:.0f}"),
    ("longest gap s", lambda m: m["longest_gap_during_s"], "{:.2f}"),
    ("long TTFT s", lambda m: m["long_ttft_s"], "{:.2f}"),
    ("short TTFT s", lambda m: m["short_ttft_s"], "{:.2f}"),
)


def _cell(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def table(sweep: Path) -> str:
    lines = ["| setting | runs | " + " | ".join(name for name, _get, _fmt in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for folder in sorted(p for p in sweep.iterdir() if p.is_dir()):
        runs: list[dict[str, Any]] = [json.loads(f.read_text())["mixed"] for f in sorted(folder.glob("bench-*.json"))]
        runs = [m for m in runs if m is not None]
        cells = [_cell([v for m in runs if (v := get(m)) is not None], fmt) for _name, get, fmt in COLUMNS]
        lines.append(f"| {folder.name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
