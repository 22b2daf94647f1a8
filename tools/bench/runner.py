"""Sends the benchmark's requests with the OpenAI client and assembles the glm53-bench/2 document."""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import openai

from .phases import COHERENCE_MAX_TOKENS, COHERENCE_PROBES, Phase, check_answer
from .prometheus_deltas import (
    CounterReset,
    PrefixCacheDelta,
    SpecDecodeDelta,
    prefix_cache_delta,
    spec_decode_delta,
)
from .server_probe import Server, ServerError, wait_until_idle
from .stream_metrics import (
    RequestResult,
    aggregate_tok_s,
    event_from_chunk,
    failed_request,
    summarize_requests,
    summarize_stream,
)

# The recipe's sampling: greedy, so runs are comparable and the draft's acceptance is deterministic.
TEMPERATURE = 0.0
TOP_P = 1.0


def stream_chat(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> RequestResult:
    sent = time.perf_counter()
    events = []
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            stream=True,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            max_tokens=max_tokens,
            stream_options={"include_usage": True},
            # vLLM reads chat_template_kwargs from the top level of the body; GLM otherwise thinks first
            # and the "decode" numbers would measure hidden reasoning.
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        for chunk in stream:
            # Time first, parse after: parsing must not shift the arrival time.
            arrived = time.perf_counter() - sent
            events.append(event_from_chunk(arrived, chunk.model_dump()))
    except openai.OpenAIError as exc:
        return failed_request(f"{type(exc).__name__}: {exc}", time.perf_counter() - sent)
    return summarize_stream(events, total_s=time.perf_counter() - sent)


@dataclass
class LevelRun:
    concurrency: int
    wall_s: float
    results: list[list[RequestResult]]  # [stream][run]


def measure_level(client: openai.OpenAI, model: str, phase: Phase, concurrency: int, runs: int,
                  max_tokens: int) -> LevelRun:
    """``concurrency`` streams side by side, each sending ``runs`` requests one after another."""
    def one_stream(_stream: int) -> list[RequestResult]:
        return [stream_chat(client, model, phase.prompt, max_tokens) for _request in range(runs)]

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one_stream, range(concurrency)))
    return LevelRun(concurrency, time.perf_counter() - start, results)


def _stats_json(results: Sequence[RequestResult]) -> dict[str, Any]:
    return {name: {"median": s.median, "mean": s.mean, "n": s.n}
            for name, s in summarize_requests(results).items()}


def level_json(run: LevelRun, spec: SpecDecodeDelta | None, prefix: PrefixCacheDelta | None) -> dict[str, Any]:
    flat = [r for stream in run.results for r in stream]
    return {
        "concurrency": run.concurrency,
        "wall_s": run.wall_s,
        "aggregate_tok_s": aggregate_tok_s(flat, run.wall_s),
        "errors": sum(1 for r in flat if r.error is not None),
        "summary": _stats_json(flat),
        "spec_decode": spec.as_json() if spec else None,
        "prefix_cache": prefix.as_json() if prefix else None,
        "requests": [{"stream": s, "run": i, **r.as_json()}
                     for s, stream in enumerate(run.results) for i, r in enumerate(stream)],
    }


@dataclass
class Benchmark:
    client: openai.OpenAI
    server: Server
    model: str
    runs: int
    max_tokens: int
    concurrency: Sequence[int]
    warnings: list[str] = field(default_factory=list)

    def _settle(self) -> None:
        # Scrape after the engine has retired the cell's last request, so its counters are in.
        try:
            wait_until_idle(self.server.metrics, timeout_s=5.0, poll_s=0.1, quiet_polls=1)
        except ServerError as exc:
            self.warnings.append(f"counters read while busy: {exc}")

    def measure_phase(self, phase: Phase) -> dict[str, Any]:
        if phase.warmup_tokens:
            stream_chat(self.client, self.model, phase.prompt, phase.warmup_tokens)
            self._settle()
        levels = []
        spec_total: SpecDecodeDelta | None = None
        prefix_total: PrefixCacheDelta | None = None
        for concurrency in self.concurrency:
            before = self.server.metrics()
            run = measure_level(self.client, self.model, phase, concurrency, self.runs, self.max_tokens)
            self._settle()
            after = self.server.metrics()
            spec = prefix = None
            if before is not None and after is not None:
                try:
                    spec, prefix = spec_decode_delta(before, after), prefix_cache_delta(before, after)
                except CounterReset as exc:
                    self.warnings.append(f"{phase.name} x{concurrency}: metrics dropped, engine restarted? {exc}")
            if spec is not None:
                spec_total = spec if spec_total is None else spec_total + spec
            if prefix is not None:
                prefix_total = prefix if prefix_total is None else PrefixCacheDelta(
                    prefix_total.queries + prefix.queries, prefix_total.hits + prefix.hits)
            levels.append(level_json(run, spec, prefix))
        return {
            "name": phase.name,
            "prompt": phase.prompt,
            "warmup_tokens": phase.warmup_tokens,
            "spec_decode": spec_total.as_json() if spec_total else None,
            "prefix_cache": prefix_total.as_json() if prefix_total else None,
            "levels": levels,
        }

    def coherence(self) -> dict[str, Any]:
        probes = []
        for prompt in COHERENCE_PROBES:
            result = stream_chat(self.client, self.model, prompt, COHERENCE_MAX_TOKENS)
            passed, reason = (False, result.error) if result.error else check_answer(result.text)
            probes.append({"prompt": prompt, "answer": result.text, "passed": passed, "reason": reason})
        return {"passed": all(p["passed"] for p in probes), "probes": probes}
