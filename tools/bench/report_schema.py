"""The glm53-bench/2 result document: its shape as data, and a small checker for it.

Hand-written instead of jsonschema so the controller venv needs nothing more; docs/benchmark-schema.md
describes the same fields, and a unit test keeps the two in step.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

SCHEMA_ID = "glm53-bench/2"


@dataclass(frozen=True)
class Nullable:
    inner: Spec


@dataclass(frozen=True)
class ListOf:
    item: Spec


@dataclass(frozen=True)
class Const:
    value: Any


class AnyObject:
    """A JSON object passed through from elsewhere (server answers, the --server-info file)."""


Spec = Union[type, Nullable, ListOf, Const, AnyObject, Mapping[str, "Spec"]]

NUMBER = float  # JSON numbers: an int is accepted where a float is expected
STAT = {"median": Nullable(NUMBER), "mean": Nullable(NUMBER), "n": int}
SPEC_DECODE = Nullable({
    "drafts": NUMBER,
    "draft_tokens": NUMBER,
    "accepted_tokens": NUMBER,
    "acceptance_ratio": Nullable(NUMBER),
    "accepted_per_step": Nullable(NUMBER),
    "mean_acceptance_length": Nullable(NUMBER),
    "per_position": ListOf({"position": int, "accepted": NUMBER, "rate": Nullable(NUMBER)}),
})
PREFIX_CACHE = Nullable({"queries": NUMBER, "hits": NUMBER, "hit_rate": Nullable(NUMBER)})
REQUEST = {
    "stream": int,
    "run": int,
    "ttft_s": Nullable(NUMBER),
    "decode_tok_s": Nullable(NUMBER),
    "delivered_tok_s": Nullable(NUMBER),
    "completion_tokens": int,
    "prompt_tokens": Nullable(int),
    "total_s": NUMBER,
    "finish_reason": Nullable(str),
    "usage_reported": bool,
    "error": Nullable(str),
}
LEVEL = {
    "concurrency": int,
    "wall_s": NUMBER,
    "aggregate_tok_s": Nullable(NUMBER),
    "errors": int,
    "summary": {"ttft_s": STAT, "decode_tok_s": STAT, "delivered_tok_s": STAT, "completion_tokens": STAT},
    "spec_decode": SPEC_DECODE,
    "prefix_cache": PREFIX_CACHE,
    "requests": ListOf(REQUEST),
}
MIXED_STREAM = {
    "stream": int,
    "error": Nullable(str),
    "completion_tokens": int,
    "before_tok_s": Nullable(NUMBER),
    "during_tok_s": Nullable(NUMBER),
    "after_tok_s": Nullable(NUMBER),
    "longest_gap_during_s": Nullable(NUMBER),
}
MIXED = Nullable({
    "streams": int,
    "long_prompt_tokens": Nullable(int),
    "long_prompt_target_tokens": int,
    "long_ttft_s": Nullable(NUMBER),
    "short_ttft_s": Nullable(NUMBER),
    "short_sent_after_long_s": NUMBER,
    "prefill_window_s": Nullable(NUMBER),
    "decode_tok_s": {"before": Nullable(NUMBER), "during": Nullable(NUMBER), "after": Nullable(NUMBER)},
    "longest_gap_during_s": Nullable(NUMBER),
    "per_stream": ListOf(MIXED_STREAM),
    "errors": ListOf(str),
    "timeline": {
        "long_sent": NUMBER,
        "long_first_token": Nullable(NUMBER),
        "short_sent": NUMBER,
        "short_first_token": Nullable(NUMBER),
        "streams": ListOf(ListOf(ListOf(NUMBER))),
    },
})
REPORT: Spec = {
    "schema": Const(SCHEMA_ID),
    "created_utc": str,
    "tool": {"name": str, "argv": ListOf(str)},
    "target": {"base_url": str, "model": str},
    "settings": {
        "runs": int,
        "max_tokens": int,
        "concurrency": ListOf(int),
        "phases": ListOf(str),
        "temperature": NUMBER,
        "top_p": NUMBER,
        "enable_thinking": bool,
        "warmup_wait_s": NUMBER,
        "mixed": Nullable({"streams": int, "long_prompt_tokens": int, "decode_tokens": int}),
    },
    "server": {
        "models": Nullable(AnyObject()),
        "metrics_available": bool,
        "spec_decode_metrics": bool,
        "spec_config": Nullable(AnyObject()),
        "serve_argv": Nullable(ListOf(str)),
        "info": Nullable(AnyObject()),
        "idle_wait_s": Nullable(NUMBER),
    },
    "coherence": Nullable({
        "passed": bool,
        "probes": ListOf({"prompt": str, "answer": str, "passed": bool, "reason": str}),
    }),
    "phases": ListOf({
        "name": str,
        "prompt": str,
        "warmup_tokens": Nullable(int),
        "spec_decode": SPEC_DECODE,
        "prefix_cache": PREFIX_CACHE,
        "levels": ListOf(LEVEL),
    }),
    "mixed": MIXED,
    "warnings": ListOf(str),
    "artifacts": {"plot": Nullable(str), "mixed_plot": Nullable(str)},
}


def _type_ok(value: Any, expected: type) -> bool:
    if expected is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # bool is an int to Python, never a number in this document
        return False
    if expected is float:
        return isinstance(value, (int, float))
    return isinstance(value, expected)


def _check(value: Any, spec: Spec, path: str, errors: list[str]) -> None:
    if isinstance(spec, Nullable):
        if value is not None:
            _check(value, spec.inner, path, errors)
    elif isinstance(spec, Const):
        if value != spec.value:
            errors.append(f"{path}: expected {spec.value!r}, got {value!r}")
    elif isinstance(spec, AnyObject):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
    elif isinstance(spec, ListOf):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _check(item, spec.item, f"{path}[{i}]", errors)
    elif isinstance(spec, Mapping):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        for key, sub in spec.items():
            if key not in value:
                errors.append(f"{path}.{key}: missing")
            else:
                _check(value[key], sub, f"{path}.{key}", errors)
        # Unknown keys are errors: a field the document does not describe is a field nobody can rely on.
        errors.extend(f"{path}.{key}: not in {SCHEMA_ID}" for key in value if key not in spec)
    elif not _type_ok(value, spec):
        errors.append(f"{path}: expected {'number' if spec is float else spec.__name__}, "
                      f"got {type(value).__name__}")


def validate_report(doc: Any) -> list[str]:
    """Every way ``doc`` differs from glm53-bench/2, as ``$.path: problem`` lines; empty when valid."""
    errors: list[str] = []
    _check(doc, REPORT, "$", errors)
    return errors


def field_paths(spec: Spec | None = None, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every named field (``phases[].levels[].wall_s``) of ``spec`` (the report), for the docs check."""
    if spec is None:
        spec = REPORT
    while isinstance(spec, (Nullable, ListOf)):
        if isinstance(spec, ListOf):
            prefix += "[]"
            spec = spec.item
        else:
            spec = spec.inner
    if isinstance(spec, Mapping):
        for key, sub in spec.items():
            path = f"{prefix}.{key}" if prefix else key
            yield path
            yield from field_paths(sub, path)
