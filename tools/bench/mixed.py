"""The mixed phase: decode streams running while a long, cold prompt arrives.

Recipe users saw one 100K-token prefill drop concurrent decode from 55 to 5 tok/s; this phase measures
exactly that. N streams decode; once each has produced a few tokens a long prompt with a unique prefix (so
the prefix cache cannot shorten it) is sent, and shortly after it a short request. Reported: each stream's
decode rate before, during and after the long prefill (the prefill window is from sending the long prompt
to its first token), its longest gap between tokens inside the window, the long prompt's TTFT and the
short request's TTFT. Timing runs on one clock (perf_counter) shared by every thread.
"""
from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

# A sentence of common words: about one token per word for GLM's and the tiny model's BPE.
_FILLER = ("the quick brown fox jumps over the lazy dog while a careful engineer measures how long "
           "each request waits for its first token ")
SHORT_PROMPT = "Name one prime number."


@dataclass(frozen=True)
class MixedSettings:
    streams: int
    long_prompt_tokens: int
    decode_tokens: int
    # Each stream's tokens before the long prompt is sent: the "before" window.
    before_tokens: int = 16
    short_delay_s: float = 0.05
    short_max_tokens: int = 8


@dataclass
class Arrivals:
    """(time, cumulative completion tokens) of one streamed request, times on the phase's clock."""

    sent: float
    points: list[tuple[float, int]] = field(default_factory=list)
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def first_token(self) -> float | None:
        return next((t for t, n in self.points if n > 0), None)

    def tokens_at(self, t: float) -> int:
        """Tokens received up to and including time t."""
        count = 0
        for when, n in self.points:
            if when > t:
                break
            count = n
        return count


def window_rate(arrivals: Arrivals, start: float, end: float) -> float | None:
    """Tokens per second that arrived in (start, end]; None for an empty window."""
    if end <= start:
        return None
    return (arrivals.tokens_at(end) - arrivals.tokens_at(start)) / (end - start)


def longest_gap(arrivals: Arrivals, start: float, end: float) -> float | None:
    """The longest time with no new token inside [start, end] (window edges count as bounds)."""
    if end <= start:
        return None
    times = [start] + [t for t, _tokens in arrivals.points if start < t < end] + [end]
    return max(b - a for a, b in zip(times, times[1:]))


@dataclass(frozen=True)
class Windows:
    before: tuple[float, float]
    during: tuple[float, float]
    after: tuple[float, float]


def prefill_windows(streams: Sequence[Arrivals], long_request: Arrivals) -> Windows | None:
    """Before: from the last stream's first token to sending the long prompt; during: until its first
    token; after: until the first stream finishes. None when the long prompt never produced a token."""
    long_first = long_request.first_token
    firsts = [s.first_token for s in streams]
    if long_first is None or not streams or any(f is None for f in firsts):
        return None
    ends = [s.points[-1][0] for s in streams]
    return Windows(before=(max(f for f in firsts if f is not None), long_request.sent),
                   during=(long_request.sent, long_first),
                   after=(long_first, min(ends)))


def summarize_mixed(settings: MixedSettings, streams: Sequence[Arrivals], long_request: Arrivals,
                    short_request: Arrivals) -> dict[str, Any]:
    windows = prefill_windows(streams, long_request)
    per_stream = []
    for i, s in enumerate(streams):
        row: dict[str, Any] = {"stream": i, "error": s.error, "completion_tokens": s.points[-1][1] if s.points else 0}
        for name in ("before", "during", "after"):
            span = getattr(windows, name) if windows else None
            row[f"{name}_tok_s"] = window_rate(s, *span) if span else None
        row["longest_gap_during_s"] = longest_gap(s, *windows.during) if windows else None
        per_stream.append(row)

    def median(key: str) -> float | None:
        values = [r[key] for r in per_stream if r[key] is not None]
        return statistics.median(values) if values else None

    def ttft(a: Arrivals) -> float | None:
        return a.first_token - a.sent if a.first_token is not None else None

    return {
        "streams": settings.streams,
        "long_prompt_tokens": long_request.prompt_tokens,
        "long_prompt_target_tokens": settings.long_prompt_tokens,
        "long_ttft_s": ttft(long_request),
        "short_ttft_s": ttft(short_request),
        "short_sent_after_long_s": short_request.sent - long_request.sent,
        "prefill_window_s": (windows.during[1] - windows.during[0]) if windows else None,
        "decode_tok_s": {name: median(f"{name}_tok_s") for name in ("before", "during", "after")},
        "longest_gap_during_s": median("longest_gap_during_s"),
        "per_stream": per_stream,
        "errors": [e for e in (long_request.error, short_request.error, *(s.error for s in streams)) if e],
        "timeline": {
            "long_sent": long_request.sent,
            "long_first_token": long_request.first_token,
            "short_sent": short_request.sent,
            "short_first_token": short_request.first_token,
            "streams": [[[t, n] for t, n in s.points] for s in streams],
        },
    }


def cold_long_prompt(count_tokens: Callable[[str], int], target: int) -> str:
    """A prompt of about `target` tokens whose first words are unique, so no cached prefix matches."""
    head = f"Request {uuid.uuid4().hex}. Summarise the following text in one sentence. "
    unit = count_tokens(_FILLER) or 1
    text = head + _FILLER * max(1, round((target - count_tokens(head)) / unit))
    # One correction step: the tokenizer merges across repeats, so the first estimate can be off.
    measured = count_tokens(text)
    if measured > target:
        text = head + _FILLER * max(1, round((target - count_tokens(head)) / unit * target / measured))
    return text


def _stream(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, clock_zero: float,
            out: Arrivals) -> None:
    out.sent = time.perf_counter() - clock_zero
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], stream=True, temperature=0.0,
            max_tokens=max_tokens, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            # Usage on every chunk: token counts over time, exact even when a chunk carries several tokens.
            stream_options={"include_usage": True, "continuous_usage_stats": True})
        for chunk in stream:
            t = time.perf_counter() - clock_zero
            usage = chunk.usage
            if usage is not None:
                out.prompt_tokens = usage.prompt_tokens
                if not out.points or usage.completion_tokens != out.points[-1][1]:
                    out.points.append((t, usage.completion_tokens))
    except openai.OpenAIError as exc:
        out.error = f"{type(exc).__name__}: {exc}"


def run_mixed(client: openai.OpenAI, model: str, count_tokens: Callable[[str], int],
              settings: MixedSettings, poll_s: float = 0.01, timeout_s: float = 600.0) -> dict[str, Any]:
    long_prompt = cold_long_prompt(count_tokens, settings.long_prompt_tokens)
    zero = time.perf_counter()
    streams = [Arrivals(sent=0.0) for _stream in range(settings.streams)]
    threads = [threading.Thread(target=_stream, daemon=True,
                                args=(client, model, f"Count from 1 to 1000, separated by commas. ({i})",
                                      settings.decode_tokens, zero, s))
               for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + timeout_s
    while any(s.tokens_at(float("inf")) < settings.before_tokens and s.error is None for s in streams):
        if time.perf_counter() > deadline:
            break
        time.sleep(poll_s)
    long_request, short_request = Arrivals(sent=0.0), Arrivals(sent=0.0)
    extra = [threading.Thread(target=_stream, daemon=True, args=(client, model, long_prompt, 4, zero, long_request))]
    extra[0].start()
    time.sleep(settings.short_delay_s)
    extra.append(threading.Thread(target=_stream, daemon=True,
                                  args=(client, model, SHORT_PROMPT, settings.short_max_tokens, zero, short_request)))
    extra[1].start()
    for t in threads + extra:
        t.join(timeout=max(0.0, deadline - time.perf_counter()))
    return summarize_mixed(settings, streams, long_request, short_request)
