"""The glm53-bench/2 document: the checker, a document assembled from recorded data, and the docs page."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest


from tools.bench.prometheus_deltas import parse_metrics, prefix_cache_delta, spec_decode_delta
from tools.bench.report_schema import SCHEMA_ID, field_paths, validate_report
from tools.bench.runner import LevelRun, level_json
from tools.bench.stream_metrics import failed_request, parse_timed_sse, summarize_stream

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "bench"
DOC = Path(__file__).resolve().parents[4] / "docs" / "benchmark-schema.md"


def example() -> dict[str, Any]:
    return json.loads((FIXTURES / "report_example.json").read_text())


def test_the_documented_example_is_valid() -> None:
    doc = example()
    assert doc["schema"] == SCHEMA_ID
    assert validate_report(doc) == []


def test_a_level_built_from_recorded_data_is_valid() -> None:
    ok = summarize_stream(parse_timed_sse((FIXTURES / "structured_dflash.sse").read_text()))
    bad = failed_request("APITimeoutError: Request timed out.", 600.0)
    before = parse_metrics((FIXTURES / "metrics_before.txt").read_text())
    after = parse_metrics((FIXTURES / "metrics_after.txt").read_text())
    level = level_json(LevelRun(2, 6.0, [[ok, ok], [ok, bad]]), spec_decode_delta(before, after),
                       prefix_cache_delta(before, after))
    assert level["errors"] == 1
    assert level["summary"]["decode_tok_s"]["n"] == 3
    assert level["aggregate_tok_s"] == pytest.approx(360 / 6.0)
    assert [(r["stream"], r["run"]) for r in level["requests"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    doc = example()
    doc["phases"][0]["levels"] = [level]
    assert validate_report(doc) == []


def _mutated(path: str, value: Any = None, delete: bool = False) -> dict[str, Any]:
    doc = copy.deepcopy(example())
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = doc
    for p in parents:
        node = node[p]
    if delete:
        del node[last]
    else:
        node[last] = value
    return doc


@pytest.mark.parametrize("path,value,delete,message", [
    ("schema", "glm53-bench/1", False, "$.schema: expected 'glm53-bench/2'"),
    ("created_utc", None, True, "$.created_utc: missing"),
    ("settings.runs", "5", False, "$.settings.runs: expected int, got str"),
    ("settings.runs", True, False, "$.settings.runs: expected int, got bool"),
    ("settings.top_p", True, False, "$.settings.top_p: expected number, got bool"),
    ("settings.concurrency", [1, "2"], False, "$.settings.concurrency[1]: expected int, got str"),
    ("phases.0.levels.0.summary.ttft_s.median", "fast", False,
     "$.phases[0].levels[0].summary.ttft_s.median: expected number, got str"),
    ("phases.0.levels.0.requests.0.error", 3, False, "$.phases[0].levels[0].requests[0].error: expected str"),
    ("phases.0.levels.0.spec_decode.per_position", {}, False,
     "$.phases[0].levels[0].spec_decode.per_position: expected a list"),
    ("server.models", [], False, "$.server.models: expected an object"),
    ("server.tokens_per_joule", 3.0, False, "$.server.tokens_per_joule: not in glm53-bench/2"),
    ("phases", {}, False, "$.phases: expected a list"),
])
def test_checker_names_the_bad_field(path: str, value: Any, delete: bool, message: str) -> None:
    errors = validate_report(_mutated(path, value, delete))
    assert any(e.startswith(message) for e in errors), errors


def test_nulls_are_allowed_where_documented() -> None:
    doc = example()
    doc["coherence"] = None
    doc["server"].update(models=None, spec_config=None, serve_argv=None, info=None, idle_wait_s=None)
    doc["phases"][0]["spec_decode"] = doc["phases"][0]["levels"][0]["spec_decode"] = None
    doc["phases"][0]["levels"][0]["summary"]["ttft_s"] = {"median": None, "mean": None, "n": 0}
    assert validate_report(doc) == []
    assert validate_report(None) == ["$: expected an object, got NoneType"]


def test_every_field_is_described_in_the_docs() -> None:
    text = DOC.read_text()
    documented = set(re.findall(r"`([a-z_0-9]+)`", text))
    missing = sorted({p for p in field_paths() if p.rsplit(".", 1)[-1] not in documented})
    assert not missing, f"describe these in {DOC.name}: {missing}"
    assert SCHEMA_ID in text
