"""The mixed phase's arithmetic on synthetic arrival times: windows, rates, gaps, TTFTs, the cold prompt."""
from __future__ import annotations

import pytest

from tools.bench.mixed import (
    Arrivals,
    MixedSettings,
    cold_long_prompt,
    longest_gap,
    prefill_windows,
    summarize_mixed,
    window_rate,
)
from tools.bench.report_schema import MIXED, _check


def steady(start: float, end: float, rate: float, pause: tuple[float, float] | None = None) -> Arrivals:
    """One token every 1/rate seconds from `start`, none inside `pause`."""
    points, t, n = [], start, 0
    while t <= end + 1e-9:
        if not (pause and pause[0] < t < pause[1]):
            n += 1
            points.append((round(t, 6), n))
        t += 1 / rate
    return Arrivals(sent=0.0, points=points)


def test_rates_count_the_tokens_inside_each_window() -> None:
    s = steady(1.0, 10.0, 10.0)
    assert window_rate(s, 2.0, 4.0) == pytest.approx(10.0, abs=0.51)
    assert window_rate(s, 4.0, 4.0) is None


def test_a_stream_starved_by_the_prefill_shows_zero_rate_and_the_whole_window_as_its_gap() -> None:
    starved = steady(0.5, 12.0, 20.0, pause=(4.0, 7.0))
    long_request = Arrivals(sent=4.0, points=[(7.0, 1), (7.1, 4)], prompt_tokens=5000)
    short = Arrivals(sent=4.05, points=[(7.2, 1)])
    doc = summarize_mixed(MixedSettings(1, 5000, 200), [starved], long_request, short)
    assert doc["decode_tok_s"]["during"] == 0.0
    assert doc["decode_tok_s"]["before"] == pytest.approx(20.0, rel=0.05)
    assert doc["decode_tok_s"]["after"] == pytest.approx(20.0, rel=0.05)
    assert doc["longest_gap_during_s"] == pytest.approx(3.0)
    assert doc["long_ttft_s"] == pytest.approx(3.0)
    assert doc["short_ttft_s"] == pytest.approx(3.15)
    assert doc["prefill_window_s"] == pytest.approx(3.0)
    assert doc["long_prompt_tokens"] == 5000


def test_a_stream_that_keeps_decoding_keeps_its_rate_and_small_gaps() -> None:
    fair = steady(0.5, 12.0, 20.0)
    doc = summarize_mixed(MixedSettings(1, 5000, 200), [fair], Arrivals(sent=4.0, points=[(7.0, 1)]),
                          Arrivals(sent=4.05, points=[(4.5, 1)]))
    assert doc["decode_tok_s"]["during"] == pytest.approx(20.0, rel=0.05)
    assert doc["longest_gap_during_s"] == pytest.approx(0.05, abs=0.01)
    assert doc["short_ttft_s"] == pytest.approx(0.45)


def test_windows_start_when_every_stream_decodes_and_end_when_the_first_stops() -> None:
    a, b = steady(0.5, 9.0, 10.0), steady(1.5, 12.0, 10.0)
    w = prefill_windows([a, b], Arrivals(sent=4.0, points=[(6.0, 1)]))
    assert w is not None
    assert w.before == (1.5, 4.0) and w.during == (4.0, 6.0) and w.after[0] == 6.0
    assert w.after[1] == pytest.approx(9.0, abs=0.1)


def test_a_long_prompt_that_never_answered_leaves_the_rates_unknown_not_zero() -> None:
    failed = Arrivals(sent=4.0, error="APITimeoutError: timed out")
    doc = summarize_mixed(MixedSettings(1, 5000, 200), [steady(0.5, 9.0, 10.0)], failed, Arrivals(sent=4.1))
    assert doc["decode_tok_s"] == {"before": None, "during": None, "after": None}
    assert doc["long_ttft_s"] is None and doc["errors"] == ["APITimeoutError: timed out"]


def test_the_document_matches_the_schema() -> None:
    doc = summarize_mixed(MixedSettings(2, 100, 64), [steady(0.1, 3, 10), steady(0.2, 3, 10)],
                          Arrivals(sent=1.0, points=[(1.5, 1)], prompt_tokens=101), Arrivals(sent=1.05, points=[(1.6, 1)]))
    errors: list[str] = []
    _check(doc, MIXED, "$.mixed", errors)
    assert errors == []


def test_longest_gap_uses_the_window_edges() -> None:
    s = Arrivals(sent=0.0, points=[(1.0, 1), (1.2, 2), (3.0, 3)])
    assert longest_gap(s, 1.1, 2.0) == pytest.approx(0.8)


def test_cold_prompts_are_near_their_size_and_never_share_a_first_word() -> None:
    def count(text: str) -> int:
        return len(text.split())
    a, b = cold_long_prompt(count, 500), cold_long_prompt(count, 500)
    assert a.split()[1] != b.split()[1]
    assert 450 <= count(a) <= 520


def test_the_terminal_table_shows_the_three_rates_and_both_ttfts() -> None:
    from rich.console import Console

    from tools.bench.results_table import mixed_table

    doc = summarize_mixed(MixedSettings(1, 5000, 200), [steady(0.5, 12.0, 20.0, pause=(4.0, 7.0))],
                          Arrivals(sent=4.0, points=[(7.0, 1)], prompt_tokens=5000), Arrivals(sent=4.05, points=[(7.2, 1)]))
    console = Console(width=200, record=True)
    console.print(mixed_table(doc))
    text = console.export_text()
    assert "5000-token prompt" in text and "0.0" in text and "3.00" in text and "3.15" in text
