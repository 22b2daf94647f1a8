"""bench_decode's per-request arithmetic on recorded vLLM streams (DFlash2 k=7, bursts of tokens per chunk)."""
from __future__ import annotations

from pathlib import Path

import pytest


from tools.bench.stream_metrics import (
    RequestResult,
    Stat,
    StreamEvent,
    aggregate_tok_s,
    event_from_chunk,
    failed_request,
    parse_timed_sse,
    summarize_requests,
    summarize_stream,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "bench"


def recorded(name: str) -> list[StreamEvent]:
    return parse_timed_sse((FIXTURES / name).read_text())


def test_structured_stream_matches_hand_arithmetic() -> None:
    # From the fixture's header: role chunk at 0.6912, first text 0.7190, last text 2.6619, 120 tokens.
    r = summarize_stream(recorded("structured_dflash.sse"))
    assert r.ttft_s == pytest.approx(0.7190)
    assert r.decode_tok_s == pytest.approx(119 / (2.6619 - 0.7190))
    assert r.delivered_tok_s == pytest.approx(120 / 2.6619)
    assert (r.completion_tokens, r.prompt_tokens, r.finish_reason, r.usage_reported) == (120, 17, "length", True)
    assert r.text.startswith("1, 2, 3,") and r.text.endswith(" 59, 60,")
    # The recipe's DFlash2 structured headline is 62.9 tok/s; the recording sits next to it.
    assert 60 < r.decode_tok_s < 63


def test_prose_stream_with_small_bursts() -> None:
    r = summarize_stream(recorded("prose_dflash.sse"))
    assert r.ttft_s == pytest.approx(0.7023)
    assert r.decode_tok_s == pytest.approx(79 / (3.6343 - 0.7023))
    assert r.delivered_tok_s == pytest.approx(80 / 3.6343)
    assert r.completion_tokens == 80


def test_tokens_come_from_usage_not_from_chunk_count() -> None:
    events = recorded("structured_dflash.sse")
    chunks_with_text = sum(1 for e in events if e.text)
    assert chunks_with_text == 26  # several tokens per chunk: counting chunks would under-report 4.6x
    assert summarize_stream(events).completion_tokens == 120


def test_role_only_first_chunk_is_not_the_first_token() -> None:
    events = recorded("prose_dflash.sse")
    assert events[0].text == "" and events[0].t == pytest.approx(0.6504)
    assert summarize_stream(events).ttft_s == pytest.approx(0.7023)


def test_without_usage_falls_back_to_text_chunks_and_says_so() -> None:
    r = summarize_stream(recorded("no_usage.sse"))
    assert (r.completion_tokens, r.usage_reported, r.finish_reason) == (10, False, "stop")
    assert r.decode_tok_s == pytest.approx(9 / (0.61 - 0.25))


def test_total_time_defaults_to_last_event_and_accepts_the_measured_one() -> None:
    events = recorded("structured_dflash.sse")
    assert summarize_stream(events).total_s == pytest.approx(2.6623)
    assert summarize_stream(events, total_s=2.7).total_s == 2.7


@pytest.mark.parametrize("events", [
    [],
    [StreamEvent(0.1, ""), StreamEvent(0.2, "", completion_tokens=0)],
])
def test_no_text_means_no_speeds(events: list[StreamEvent]) -> None:
    r = summarize_stream(events)
    assert (r.ttft_s, r.decode_tok_s, r.delivered_tok_s) == (None, None, None)


def test_a_single_token_has_ttft_but_no_decode_speed() -> None:
    r = summarize_stream([StreamEvent(0.5, "Hi", finish_reason="length"),
                          StreamEvent(0.5001, "", completion_tokens=1)])
    assert r.ttft_s == 0.5 and r.decode_tok_s is None and r.delivered_tok_s == pytest.approx(2.0)


def test_reasoning_tokens_count_as_text() -> None:
    chunk = {"choices": [{"delta": {"reasoning_content": "hmm", "content": None}, "finish_reason": None}]}
    assert event_from_chunk(0.3, chunk).text == "hmm"
    assert event_from_chunk(0.3, {"choices": [], "usage": None}).text == ""


def test_timed_sse_needs_times() -> None:
    with pytest.raises(ValueError, match="': t='"):
        parse_timed_sse('data: {"choices": []}\n\n')


def test_medians_means_and_aggregate_skip_failed_requests() -> None:
    ok = [summarize_stream(recorded("structured_dflash.sse")), summarize_stream(recorded("prose_dflash.sse"))]
    bad = failed_request("APIConnectionError: boom", 0.01)
    stats = summarize_requests([*ok, bad])
    decode = [r.decode_tok_s for r in ok]
    assert stats["decode_tok_s"] == Stat(pytest.approx(sum(decode) / 2), pytest.approx(sum(decode) / 2), 2)
    assert stats["completion_tokens"].median == 100.0
    assert aggregate_tok_s([*ok, bad], wall_s=4.0) == pytest.approx(200 / 4.0)
    assert aggregate_tok_s([bad], wall_s=4.0) is None


def test_stat_of_odd_and_empty() -> None:
    assert Stat.of([3.0, 1.0, 2.0, None]) == Stat(2.0, 2.0, 3)
    assert Stat.of([]) == Stat(None, None, 0)


def test_request_json_leaves_the_text_out_by_default() -> None:
    r: RequestResult = summarize_stream(recorded("no_usage.sse"))
    assert "text" not in r.as_json() and r.as_json(with_text=True)["text"].startswith("Paris")
