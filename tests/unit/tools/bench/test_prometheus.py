"""Spec-decode and prefix-cache deltas from recorded vLLM /metrics texts (prometheus_client exposition)."""
from __future__ import annotations

from pathlib import Path

import pytest


from tools.bench.prometheus_deltas import (
    ACCEPTED,
    DRAFTS,
    PREFIX_QUERIES,
    CounterReset,
    SpecDecodeDelta,
    has_spec_decode,
    parse_metrics,
    per_position,
    prefix_cache_delta,
    requests_in_flight,
    spec_decode_delta,
    total,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "bench"


def scrape(name: str) -> dict:
    return parse_metrics((FIXTURES / name).read_text())


def test_spec_decode_delta_between_two_scrapes() -> None:
    # metrics_after = metrics_before + one cell: 480 drafts of k=7, 1536 tokens accepted.
    spec = spec_decode_delta(scrape("metrics_before.txt"), scrape("metrics_after.txt"))
    assert spec is not None
    assert (spec.drafts, spec.draft_tokens, spec.accepted_tokens) == (480, 3360, 1536)
    assert spec.acceptance_ratio == pytest.approx(1536 / 3360)
    assert spec.accepted_per_step == pytest.approx(3.2)
    assert spec.mean_acceptance_length == pytest.approx(4.2)
    assert spec.accepted_per_position == {0: 432, 1: 360, 2: 276, 3: 204, 4: 132, 5: 84, 6: 48}
    rates = spec.position_rates()
    assert list(rates) == list(range(7))
    assert rates[0] == pytest.approx(0.9) and rates[6] == pytest.approx(0.1)
    # Per-position acceptance can only fall: position i+1 is accepted only after position i was.
    assert all(rates[p] >= rates[p + 1] for p in range(6))
    # The per-position totals add up to the accepted total.
    assert sum(spec.accepted_per_position.values()) == spec.accepted_tokens


def test_prefix_cache_delta() -> None:
    prefix = prefix_cache_delta(scrape("metrics_before.txt"), scrape("metrics_after.txt"))
    assert prefix is not None
    assert (prefix.queries, prefix.hits) == (85, 80)
    assert prefix.hit_rate == pytest.approx(80 / 85)


def test_created_series_are_not_counted() -> None:
    snap = scrape("metrics_before.txt")
    assert total(snap, DRAFTS) == 10234  # not 10234 + 1.76e9 from vllm:spec_decode_num_drafts_created
    assert not any(name.endswith("_created") for name, _labels in snap)


def test_data_parallel_engines_are_summed() -> None:
    snap = scrape("metrics_dp2.txt")
    assert total(snap, DRAFTS) == 10234 + 1000
    assert total(snap, ACCEPTED) == 30455 + 2800
    assert per_position(snap)[0] == 8611 + 800
    assert total(snap, PREFIX_QUERIES) == 152340 + 1000
    assert requests_in_flight(snap) == (1.0, 0.0)


def test_server_without_speculation() -> None:
    snap = scrape("metrics_no_spec.txt")
    assert not has_spec_decode(snap) and has_spec_decode(scrape("metrics_before.txt"))
    assert spec_decode_delta(snap, snap) is None
    prefix = prefix_cache_delta(snap, snap)
    assert prefix is not None and prefix.hit_rate is None  # no queries in between: no rate, not 0 %


def test_idle_and_busy_gauges() -> None:
    assert requests_in_flight(scrape("metrics_before.txt")) == (0.0, 0.0)
    assert requests_in_flight(scrape("metrics_busy.txt")) == (1.0, 2.0)
    assert requests_in_flight(parse_metrics("# TYPE up gauge\nup 1\n")) is None


def test_engine_restart_is_reported_not_turned_into_negative_rates() -> None:
    with pytest.raises(CounterReset, match="num_drafts"):
        spec_decode_delta(scrape("metrics_after.txt"), scrape("metrics_before.txt"))
    with pytest.raises(CounterReset, match="prefix_cache_queries"):
        prefix_cache_delta(scrape("metrics_after.txt"), scrape("metrics_before.txt"))


def test_counter_typed_without_total_suffix() -> None:
    # Other exporters (and OpenMetrics) name the family without _total; the samples still get the suffix.
    before = parse_metrics("# TYPE vllm:spec_decode_num_drafts counter\n"
                           'vllm:spec_decode_num_drafts{engine="0"} 10\n')
    after = parse_metrics("# TYPE vllm:spec_decode_num_drafts counter\n"
                          'vllm:spec_decode_num_drafts_total{engine="0"} 14\n'
                          "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
                          'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 9\n')
    spec = spec_decode_delta(before, after)
    assert spec is not None and (spec.drafts, spec.accepted_tokens, spec.draft_tokens) == (4, 9, 0)
    assert spec.acceptance_ratio is None  # no draft-token counter: no ratio rather than a division by zero


def test_deltas_add_up_across_cells() -> None:
    a = SpecDecodeDelta(10, 70, 30, {0: 9, 1: 7})
    b = SpecDecodeDelta(5, 35, 10, {0: 4, 2: 1})
    s = a + b
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (15, 105, 40)
    assert s.accepted_per_position == {0: 13, 1: 7, 2: 1}
    assert s.as_json()["per_position"][0] == {"position": 0, "accepted": 13, "rate": pytest.approx(13 / 15)}
