"""Per-request timing of a streamed chat completion, and the medians and means over many requests.

One function turns (arrival time, chunk) pairs into the numbers the recipe's bench_decode reports, so live
streams and recorded fixtures go through the same arithmetic.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StreamEvent:
    """One SSE chunk as the client saw it; ``t`` is seconds since the request was sent."""

    t: float
    text: str
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class RequestResult:
    ttft_s: float | None
    decode_tok_s: float | None
    delivered_tok_s: float | None
    completion_tokens: int
    prompt_tokens: int | None
    total_s: float
    finish_reason: str | None
    usage_reported: bool
    text: str
    error: str | None = None

    def as_json(self, with_text: bool = False) -> dict[str, Any]:
        doc = asdict(self)
        if not with_text:
            del doc["text"]
        return doc


def event_from_chunk(t: float, chunk: Mapping[str, Any]) -> StreamEvent:
    """Reads an OpenAI ``chat.completion.chunk`` (a dict, as sent on the wire or ``model_dump()``-ed)."""
    text = ""
    finish = None
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        # With thinking off the answer is in content; a server that still reasons puts tokens in
        # reasoning_content (vLLM) or reasoning, and those tokens cost decode time just the same.
        for key in ("reasoning_content", "reasoning", "content"):
            piece = delta.get(key)
            if isinstance(piece, str):
                text += piece
        finish = choice.get("finish_reason") or finish
    usage = chunk.get("usage") or {}
    return StreamEvent(t=t, text=text, completion_tokens=usage.get("completion_tokens"),
                       prompt_tokens=usage.get("prompt_tokens"), finish_reason=finish)


def summarize_stream(events: Sequence[StreamEvent], total_s: float | None = None) -> RequestResult:
    """TTFT, decode tok/s = (n - 1) / (t_last - t_first), delivered tok/s = n / t_last.

    The first token is the first chunk carrying text: vLLM opens every stream with a role-only chunk
    whose content is empty, and counting it would flatter TTFT. ``n`` comes from the usage chunk
    because with speculative decoding one chunk carries several tokens; without usage the number of
    text chunks is the best lower bound, flagged by ``usage_reported``.
    """
    text_events = [e for e in events if e.text]
    usage = next((e for e in reversed(events) if e.completion_tokens is not None), None)
    prompt = next((e.prompt_tokens for e in reversed(events) if e.prompt_tokens is not None), None)
    finish = next((e.finish_reason for e in reversed(events) if e.finish_reason), None)
    n = usage.completion_tokens if usage is not None and usage.completion_tokens is not None else len(text_events)
    end = total_s if total_s is not None else (events[-1].t if events else 0.0)
    text = "".join(e.text for e in text_events)
    if not text_events:
        return RequestResult(None, None, None, n, prompt, end, finish, usage is not None, text)
    t_first, t_last = text_events[0].t, text_events[-1].t
    decode = (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else None
    delivered = n / t_last if t_last > 0 else None
    return RequestResult(t_first, decode, delivered, n, prompt, end, finish, usage is not None, text)


def failed_request(error: str, total_s: float) -> RequestResult:
    return RequestResult(None, None, None, 0, None, total_s, None, False, "", error)


def parse_timed_sse(text: str) -> list[StreamEvent]:
    """Reads a recorded stream: SSE where each event is preceded by a ``: t=SECONDS`` comment.

    SSE comments are ignored by every client, so a recording stays a valid stream that a fake server
    can replay byte for byte while the arrival times travel with it.
    """
    events: list[StreamEvent] = []
    t: float | None = None
    for block in text.split("\n\n"):
        data = None
        for line in block.splitlines():
            if line.startswith(": t="):
                t = float(line[4:])
            elif line.startswith("data:"):
                data = line[5:].strip()
        if data is None or data == "[DONE]":
            continue
        if t is None:
            raise ValueError("recorded stream: an event without a preceding ': t=' comment")
        events.append(event_from_chunk(t, json.loads(data)))
    return events


@dataclass(frozen=True)
class Stat:
    median: float | None
    mean: float | None
    n: int

    @classmethod
    def of(cls, values: Iterable[float | int | None]) -> Stat:
        present = [float(v) for v in values if v is not None]
        if not present:
            return cls(None, None, 0)
        return cls(statistics.median(present), statistics.fmean(present), len(present))


SUMMARY_FIELDS = ("ttft_s", "decode_tok_s", "delivered_tok_s", "completion_tokens")


def summarize_requests(results: Sequence[RequestResult]) -> dict[str, Stat]:
    ok = [r for r in results if r.error is None]
    return {name: Stat.of(getattr(r, name) for r in ok) for name in SUMMARY_FIELDS}


def aggregate_tok_s(results: Sequence[RequestResult], wall_s: float) -> float | None:
    """What the server delivered to all streams together: every completion token over the wall time."""
    tokens = sum(r.completion_tokens for r in results if r.error is None)
    return tokens / wall_s if wall_s > 0 and tokens else None
