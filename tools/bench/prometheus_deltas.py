"""Spec-decode acceptance and prefix-cache hits from two /metrics scrapes of a vLLM server.

vLLM only exposes running totals, so every rate here is a difference of two scrapes taken around one
phase x concurrency cell. Totals are summed over the ``engine`` and ``model_name`` labels (one series
per data-parallel engine); only ``position`` is kept, because it is what the per-position rates need.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"

_KEPT_LABELS = ("position",)

# (sample name, kept labels) -> value, summed over every other label.
Snapshot = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parses Prometheus text exposition into summed samples.

    The parser names a counter family without ``_total`` but keeps (or adds) it on the samples, so the
    sample names are the stable key whatever the server's TYPE line says. ``_created`` series are
    timestamps, not counts, and would be summed into nonsense.
    """
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = tuple((k, sample.labels[k]) for k in _KEPT_LABELS if k in sample.labels)
            key = (sample.name, labels)
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def total(snapshot: Snapshot, name: str) -> float | None:
    values = [v for (n, _labels), v in snapshot.items() if n == name]
    return sum(values) if values else None


def per_position(snapshot: Snapshot, name: str = ACCEPTED_PER_POS) -> dict[int, float]:
    out: dict[int, float] = {}
    for (n, labels), v in snapshot.items():
        if n == name:
            position = dict(labels).get("position")
            if position is not None:
                out[int(position)] = out.get(int(position), 0.0) + v
    return out


def has_spec_decode(snapshot: Snapshot) -> bool:
    return total(snapshot, DRAFTS) is not None


def requests_in_flight(snapshot: Snapshot) -> tuple[float, float] | None:
    """(running, waiting), or None when the server does not export the scheduler gauges."""
    running, waiting = total(snapshot, RUNNING), total(snapshot, WAITING)
    if running is None or waiting is None:
        return None
    return running, waiting


class CounterReset(ValueError):
    """A total went down between the scrapes: the engine restarted and the delta means nothing."""


def _delta(before: Snapshot, after: Snapshot, name: str) -> float | None:
    b, a = total(before, name), total(after, name)
    if a is None:
        return None
    d = a - (b or 0.0)
    if d < 0:
        raise CounterReset(f"{name} went from {b} to {a}")
    return d


@dataclass(frozen=True)
class SpecDecodeDelta:
    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_position: dict[int, float]

    @property
    def acceptance_ratio(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def accepted_per_step(self) -> float | None:
        return self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def mean_acceptance_length(self) -> float | None:
        # Each verification step yields the accepted draft tokens plus the one token the target samples.
        per_step = self.accepted_per_step
        return None if per_step is None else 1.0 + per_step

    def position_rates(self) -> dict[int, float | None]:
        """Share of drafts whose token at this position was accepted (vLLM's own per-position rate)."""
        return {p: (v / self.drafts if self.drafts else None)
                for p, v in sorted(self.accepted_per_position.items())}

    def __add__(self, other: SpecDecodeDelta) -> SpecDecodeDelta:
        positions = set(self.accepted_per_position) | set(other.accepted_per_position)
        return SpecDecodeDelta(
            self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
            self.accepted_tokens + other.accepted_tokens,
            {p: self.accepted_per_position.get(p, 0.0) + other.accepted_per_position.get(p, 0.0)
             for p in sorted(positions)})

    def as_json(self) -> dict[str, object]:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_ratio": self.acceptance_ratio,
            "accepted_per_step": self.accepted_per_step,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position": [{"position": p, "accepted": self.accepted_per_position[p], "rate": r}
                             for p, r in self.position_rates().items()],
        }


def spec_decode_delta(before: Snapshot, after: Snapshot) -> SpecDecodeDelta | None:
    """None when the server runs without speculative decoding (vLLM then omits the counters)."""
    drafts = _delta(before, after, DRAFTS)
    if drafts is None:
        return None
    pos_before, pos_after = per_position(before), per_position(after)
    positions: dict[int, float] = {}
    for p, a in pos_after.items():
        d = a - pos_before.get(p, 0.0)
        if d < 0:
            raise CounterReset(f"{ACCEPTED_PER_POS}{{position={p}}} went from {pos_before.get(p)} to {a}")
        positions[p] = d
    return SpecDecodeDelta(drafts, _delta(before, after, DRAFT_TOKENS) or 0.0,
                           _delta(before, after, ACCEPTED) or 0.0, dict(sorted(positions.items())))


@dataclass(frozen=True)
class PrefixCacheDelta:
    queries: float
    hits: float

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None

    def as_json(self) -> dict[str, float | None]:
        return {"queries": self.queries, "hits": self.hits, "hit_rate": self.hit_rate}


def prefix_cache_delta(before: Snapshot, after: Snapshot) -> PrefixCacheDelta | None:
    queries = _delta(before, after, PREFIX_QUERIES)
    if queries is None:
        return None
    return PrefixCacheDelta(queries, _delta(before, after, PREFIX_HITS) or 0.0)
