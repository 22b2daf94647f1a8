"""The PNG and the terminal table, drawn from the documented example result."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any


from rich.console import Console

from tools.bench.decode_plot import write_decode_plot
from tools.bench.results_table import results_table

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def example() -> dict[str, Any]:
    return json.loads((FIXTURES / "report_example.json").read_text())


def test_plot_with_acceptance_bars(tmp_path: Path) -> None:
    out = write_decode_plot(example(), tmp_path / "bench.png")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_plot_without_spec_data_and_with_a_failed_cell(tmp_path: Path) -> None:
    report = example()
    report["server"].update(spec_decode_metrics=False, spec_config=None)
    for phase in report["phases"]:
        phase["spec_decode"] = None
        for level in phase["levels"]:
            level["spec_decode"] = None
    report["phases"][1]["levels"][1]["aggregate_tok_s"] = None
    report["phases"][1]["levels"][1]["summary"]["decode_tok_s"]["median"] = None
    out = write_decode_plot(report, tmp_path / "nospec.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_table_shows_the_headline_numbers() -> None:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(results_table(example()))
    text = console.export_text()
    structured_c1 = next(line for line in text.splitlines() if "structured" in line)
    # decode median 61.2 tok/s, TTFT 719 ms, acceptance 45.7 %, mean length 4.20, prefix hits 94 %
    for cell in ("61.2", "719", "45.7%", "4.20", "94%"):
        assert cell in structured_c1, (cell, structured_c1)
    assert text.count("prose") == 2
