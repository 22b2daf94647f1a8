# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""The quality gate of the ``vllm_quality`` module: the served model's next-token distributions against a
teacher's, over a reference set of token windows (format: docs/quality-gate.md).

Everything that decides is a pure function over plain data: reading the set, reading vLLM's
``prompt_logprobs``, the per-position KL divergence, the summary and the verdict. The runner takes its
HTTP and clock as arguments, so tests drive it without a server.

The KL divergence is computed on what both sides report: the teacher's top-k log-probabilities and the
served top-k' (full-vocabulary log-softmax values, not renormalised). It is the smallest KL(teacher || served)
over the partition "teacher top-k + rest" that distributions consistent with those reports allow, hence never
above the true one, so a failed gate is never an artefact of truncation; see ``position_kld``.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.sparkops.glm53.plugins.module_utils.health import HttpResult, api_headers

REFERENCE_FORMAT = "sparkops-glm53-quality-reference"
REFERENCE_VERSION = 1
REPORT_FORMAT = "sparkops-glm53-quality-report"
METADATA_FILE = "reference.json"
# Served log-probabilities travel as float32: mass sums closer to 1 than this cannot be told apart.
MASS_FLOOR = 1e-6
BODY_LIMIT = 2000

HttpCall = Callable[[str, str, Mapping[str, str], Optional[bytes], float], HttpResult]


class QualityError(Exception):
    """Bad reference set or an answer the gate cannot score; the message names what and where."""


# --------------------------------------------------------------------------- the reference set


@dataclass(frozen=True)
class Window:
    """One token window. ``top_ids[i]``/``top_logprobs[i]`` are the teacher's top-k for token
    ``token_ids[scored_from + i]`` given the tokens before it (vLLM's ``prompt_logprobs`` indexing)."""

    id: str
    token_ids: Tuple[int, ...]
    scored_from: int
    top_ids: Tuple[Tuple[int, ...], ...]
    top_logprobs: Tuple[Tuple[float, ...], ...]
    kind: str = ""

    @property
    def positions(self) -> int:
        return len(self.top_ids)


@dataclass(frozen=True)
class ReferenceSet:
    metadata: Dict[str, Any]
    windows: Tuple[Window, ...]

    @property
    def top_k(self) -> int:
        return int(self.metadata["top_k"])

    @property
    def positions(self) -> int:
        return sum(w.positions for w in self.windows)


def parse_window(data: Mapping[str, Any], top_k: int, where: str) -> Window:
    try:
        window = Window(
            id=str(data["id"]),
            token_ids=tuple(int(t) for t in data["token_ids"]),
            scored_from=int(data["scored_from"]),
            top_ids=tuple(tuple(int(t) for t in row) for row in data["top_ids"]),
            top_logprobs=tuple(tuple(float(v) for v in row) for row in data["top_logprobs"]),
            kind=str(data.get("kind", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise QualityError("%s: not a reference window (%s: %s)" % (where, type(exc).__name__, exc)) from exc
    if not 1 <= window.scored_from < len(window.token_ids):
        raise QualityError("%s: scored_from %d outside 1..%d" % (where, window.scored_from, len(window.token_ids) - 1))
    if window.positions != len(window.token_ids) - window.scored_from or len(window.top_logprobs) != window.positions:
        raise QualityError("%s: %d token ids from %d need %d rows of top_ids and top_logprobs, found %d and %d" % (
            where, len(window.token_ids), window.scored_from, len(window.token_ids) - window.scored_from,
            len(window.top_ids), len(window.top_logprobs)))
    for i, (ids, lps) in enumerate(zip(window.top_ids, window.top_logprobs)):
        if len(ids) != top_k or len(lps) != top_k or len(set(ids)) != top_k:
            raise QualityError("%s: row %d must hold %d distinct ids and as many log-probabilities" % (where, i, top_k))
        if any(lp > 1e-6 for lp in lps) or math.fsum(math.exp(lp) for lp in lps) > 1 + 1e-4:
            raise QualityError("%s: row %d is not full-vocabulary log-probabilities (positive, or summing above 1)"
                               % (where, i))
    return window


def parse_reference(metadata: Mapping[str, Any], window_lines: Sequence[str], where: str) -> ReferenceSet:
    if metadata.get("format") != REFERENCE_FORMAT or metadata.get("version") != REFERENCE_VERSION:
        raise QualityError("%s: format %r version %r; this gate reads %s version %d" % (
            where, metadata.get("format"), metadata.get("version"), REFERENCE_FORMAT, REFERENCE_VERSION))
    top_k = metadata.get("top_k")
    if not isinstance(top_k, int) or top_k < 1:
        raise QualityError("%s: top_k must be a positive integer, found %r" % (where, top_k))
    windows: List[Window] = []
    for number, line in enumerate(window_lines, 1):
        if line.strip():
            try:
                data = json.loads(line)
            except ValueError as exc:
                raise QualityError("%s line %d: not JSON (%s)" % (where, number, exc)) from exc
            windows.append(parse_window(data, top_k, "%s line %d" % (where, number)))
    if not windows:
        raise QualityError("%s holds no windows" % where)
    if len({w.id for w in windows}) != len(windows):
        raise QualityError("%s: window ids are not unique" % where)
    return ReferenceSet(dict(metadata), tuple(windows))


def load_reference(directory: str) -> ReferenceSet:
    meta_path = os.path.join(directory, METADATA_FILE)
    try:
        with open(meta_path, encoding="utf-8") as handle:
            metadata = json.load(handle)
        windows_path = os.path.join(directory, str(metadata.get("windows_file", "windows.jsonl")))
        with open(windows_path, encoding="utf-8") as handle:
            lines = handle.readlines()
    except (OSError, ValueError) as exc:
        raise QualityError("cannot read the reference set in %s: %s" % (directory, exc)) from exc
    return parse_reference(metadata, lines, windows_path)


# --------------------------------------------------------------------------- one position


@dataclass(frozen=True)
class ServedPosition:
    """vLLM's ``prompt_logprobs`` entry for one position: every listed token's log-probability, and the
    ids vLLM ranked within the requested top-k (the prompt's own token is listed too, at its true rank)."""

    logprobs: Dict[int, float]
    top: Tuple[int, ...]


def parse_served_position(entry: Mapping[str, Any], top_k: int) -> ServedPosition:
    logprobs: Dict[int, float] = {}
    ranked: List[Tuple[int, int]] = []
    for key, value in entry.items():
        token = int(key)
        logprobs[token] = float(value["logprob"])
        rank = value.get("rank")
        if rank is not None and int(rank) <= top_k:
            ranked.append((int(rank), token))
    ranked.sort()
    return ServedPosition(logprobs, tuple(token for _rank, token in ranked))


def _xlogy_ratio(p: float, log_p: float, log_q: float) -> float:
    return 0.0 if p == 0.0 else p * (log_p - log_q)


def position_kld(teacher_ids: Sequence[int], teacher_logprobs: Sequence[float], served: ServedPosition) -> float:
    """KL(teacher || served) in nats for one position: the smallest value consistent with both top-k reports.

    Both sides' values are full-vocabulary log-probabilities; nothing is renormalised. Renormalising over the
    shared tokens would compare only the shapes inside the top-k, and a served model that keeps the right
    order but leaks mass to the rest of the vocabulary (a wrong scale, a broken kernel's flattened logits)
    would score 0.

    The partition is each teacher top-k token, plus one bucket R for the rest of the vocabulary. Over it the
    teacher is known exactly (R holds 1 - its listed mass). The served side is known for the teacher tokens it
    lists; for the others (set M) and for R it is constrained by what it reports:

    - each x_i, i in M, is at most the cap c, the smallest probability in the served top-k (an unlisted token
      ranks below all of them);
    - R holds every listed served token that is not a teacher token, so q_R >= S, their summed mass;
    - the x_i and q_R share B = 1 - (served mass of the listed teacher tokens).

    Proof sketch of the bound and its tightness. Merging the tokens of R into one bucket cannot raise a KL
    divergence (log-sum inequality), so KL over the partition is at most the full-vocabulary KL for every
    served distribution that matches the reports; we return its minimum over the feasible (x, q_R). The
    objective sum_i p_i log(p_i / x_i) + p_R log(p_R / q_R) is convex and the constraints are linear, so the KKT
    conditions are sufficient: with a multiplier lam for the budget, x_i = min(c, p_i / lam) and
    q_R = max(S, p_R / lam), where lam is the one value at which they sum to B (their sum falls as lam grows,
    found by bisection). The minimiser is feasible, so the value is attained: no smaller value is consistent
    with the reports, and none we return exceeds the partition KL of any consistent distribution. With both
    reports the same distribution, the minimiser is that distribution and the value is 0.
    """
    p = [math.exp(lp) for lp in teacher_logprobs]
    p_rest = max(0.0, 1.0 - math.fsum(p))
    teacher = set(teacher_ids)
    terms: List[float] = []
    listed_teacher_mass: List[float] = []
    missing: List[Tuple[float, float]] = []
    for token, p_t, lp_t in zip(teacher_ids, p, teacher_logprobs):
        if token in served.logprobs:
            lq = served.logprobs[token]
            terms.append(_xlogy_ratio(p_t, lp_t, lq))
            listed_teacher_mass.append(math.exp(lq))
        else:
            missing.append((p_t, lp_t))
    others = math.fsum(math.exp(lq) for token, lq in served.logprobs.items() if token not in teacher)
    budget = max(MASS_FLOOR, 1.0 - math.fsum(listed_teacher_mass))
    top_logprobs = [served.logprobs[t] for t in served.top]
    log_cap = min(top_logprobs) if top_logprobs else 0.0
    cap = math.exp(log_cap)
    # Float32 reports may overfill the budget by rounding: the missing tokens keep a sliver of it.
    rest_floor = min(others, budget * (1.0 - 1e-9))
    lam = _budget_multiplier([p_t for p_t, _lp in missing], p_rest, cap, rest_floor, budget)
    for p_t, lp_t in missing:
        log_x = log_cap if lam == 0.0 or p_t >= lam * cap else lp_t - math.log(lam)
        terms.append(_xlogy_ratio(p_t, lp_t, log_x))
    if p_rest > 0.0:
        q_rest = max(rest_floor, p_rest / lam)
        terms.append(p_rest * (math.log(p_rest) - math.log(q_rest)))
    # Each term can be negative; their sum cannot (it is a KL divergence), up to rounding.
    return max(0.0, math.fsum(terms))


def _budget_multiplier(p_missing: Sequence[float], p_rest: float, cap: float, rest_floor: float,
                       budget: float) -> float:
    """The lam at which sum_i min(cap, p_i / lam) + max(rest_floor, p_rest / lam) equals the budget; 0 when the
    teacher has no rest mass and every missing token at its cap leaves budget over (the rest bucket takes it
    at no cost, so each x_i sits at the cap)."""
    def filled(lam: float) -> float:
        return math.fsum(min(cap, p_t / lam) for p_t in p_missing) + max(rest_floor, p_rest / lam)

    if p_rest == 0.0 and len(p_missing) * cap + rest_floor <= budget:
        return 0.0
    # filled() falls from above the budget (small lam) to rest_floor < budget (large lam).
    low, high = 1e-300, 1.0
    while filled(high) > budget and high < 1e300:
        high *= 2.0
    # Bisection in log space: lam spans many orders of magnitude (a token at 1e-9 against one at 0.9).
    for _step in range(200):
        mid = math.sqrt(low * high)
        if filled(mid) > budget:
            low = mid
        else:
            high = mid
    return high


# --------------------------------------------------------------------------- windows and the verdict


@dataclass(frozen=True)
class WindowScore:
    id: str
    kind: str
    positions: int
    kld: float
    top1: float
    max_kld: float
    worst_position: int
    teacher_top1: int
    served_top1: Optional[int]

    def to_dict(self) -> Dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "positions": self.positions, "kld": round(self.kld, 6),
                "top1": round(self.top1, 4), "max_position_kld": round(self.max_kld, 6),
                "worst_position": self.worst_position, "teacher_top1_there": self.teacher_top1,
                "served_top1_there": self.served_top1}


def parse_served_window(body: str, window: Window, top_k: int) -> List[ServedPosition]:
    """The served entries for the window's scored positions, from a /v1/completions response body."""
    try:
        data = json.loads(body)
        entries = data["choices"][0]["prompt_logprobs"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise QualityError("window %s: the response has no choices[0].prompt_logprobs (%s): %s" % (
            window.id, type(exc).__name__, body[:BODY_LIMIT])) from exc
    if not isinstance(entries, list) or len(entries) != len(window.token_ids):
        raise QualityError("window %s: %s prompt_logprobs entries for %d prompt tokens" % (
            window.id, len(entries) if isinstance(entries, list) else "no", len(window.token_ids)))
    served: List[ServedPosition] = []
    for index in range(window.scored_from, len(window.token_ids)):
        entry = entries[index]
        if not isinstance(entry, dict) or not entry:
            raise QualityError("window %s: position %d has no log-probabilities" % (window.id, index))
        served.append(parse_served_position(entry, top_k))
    return served


def score_window(window: Window, served: Sequence[ServedPosition]) -> WindowScore:
    if len(served) != window.positions:
        raise QualityError("window %s: %d served positions for %d scored" % (window.id, len(served), window.positions))
    klds = [position_kld(ids, lps, s) for ids, lps, s in zip(window.top_ids, window.top_logprobs, served)]
    agree = [bool(s.top) and s.top[0] == ids[0] for ids, s in zip(window.top_ids, served)]
    worst = max(range(len(klds)), key=klds.__getitem__)
    return WindowScore(
        id=window.id, kind=window.kind, positions=window.positions, kld=math.fsum(klds) / len(klds),
        top1=sum(agree) / len(agree), max_kld=klds[worst], worst_position=window.scored_from + worst,
        teacher_top1=window.top_ids[worst][0], served_top1=served[worst].top[0] if served[worst].top else None,
    )


@dataclass(frozen=True)
class Thresholds:
    max_kld: float
    min_top1: float


@dataclass(frozen=True)
class Verdict:
    passed: bool
    kld: float
    top1: float
    positions: int
    reasons: Tuple[str, ...]
    worst: Tuple[WindowScore, ...]


def judge(scores: Sequence[WindowScore], thresholds: Thresholds, worst_count: int = 3) -> Verdict:
    """Position-weighted means over every window; fails on either threshold, naming both numbers."""
    if not scores:
        raise QualityError("no window was scored")
    positions = sum(s.positions for s in scores)
    kld = math.fsum(s.kld * s.positions for s in scores) / positions
    top1 = math.fsum(s.top1 * s.positions for s in scores) / positions
    reasons: List[str] = []
    if not kld <= thresholds.max_kld:
        reasons.append("mean KLD %.4f nats > max_kld %g" % (kld, thresholds.max_kld))
    if not top1 >= thresholds.min_top1:
        reasons.append("top-1 agreement %.4f < min_top1 %g" % (top1, thresholds.min_top1))
    worst = tuple(sorted(scores, key=lambda s: (-s.kld, s.id))[:max(0, worst_count)])
    return Verdict(not reasons, kld, top1, positions, tuple(reasons), worst)


def describe_worst(worst: Sequence[WindowScore]) -> str:
    return ", ".join("%s (KLD %.4f, top-1 %.2f)" % (s.id, s.kld, s.top1) for s in worst)


def verdict_message(verdict: Verdict) -> str:
    head = "quality gate %s: mean KLD %.4f nats, top-1 agreement %.4f over %d positions" % (
        "passed" if verdict.passed else "FAILED", verdict.kld, verdict.top1, verdict.positions)
    if verdict.reasons:
        head += " (%s)" % "; ".join(verdict.reasons)
    return head + "; worst windows: " + describe_worst(verdict.worst)


# --------------------------------------------------------------------------- the run against a server


@dataclass(frozen=True)
class GateConfig:
    url: str
    served_model_name: str
    thresholds: Thresholds
    api_key: Optional[str] = None
    request_timeout: float = 600.0
    worst_count: int = 3
    reference_id: str = ""
    # Which incarnation of the ranks answered (the head rank's container id and start time): a pass measured
    # against the same running ranks, set and thresholds is not measured again (reusable_pass).
    served_by: str = ""


@dataclass
class GateIO:
    http: HttpCall
    clock: Callable[[], float]
    now_iso: Callable[[], str]


@dataclass
class GateOutcome:
    failed: bool
    msg: str
    report: Dict[str, Any] = field(default_factory=dict)


def completion_request(window: Window, served_model_name: str, top_k: int) -> Dict[str, Any]:
    """Token ids in, the served top-k at every prompt position out; one generated token (vLLM needs >= 1)."""
    return {"model": served_model_name, "prompt": list(window.token_ids), "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": top_k}


def build_report(cfg: GateConfig, reference: ReferenceSet, verdict: Verdict, scores: Sequence[WindowScore],
                 time_iso: str, elapsed_s: float) -> Dict[str, Any]:
    return {
        "format": REPORT_FORMAT,
        "version": 1,
        "time": time_iso,
        "passed": verdict.passed,
        "reasons": list(verdict.reasons),
        "kld": round(verdict.kld, 6),
        "top1": round(verdict.top1, 6),
        "max_kld": cfg.thresholds.max_kld,
        "min_top1": cfg.thresholds.min_top1,
        "positions": verdict.positions,
        "worst_windows": [s.to_dict() for s in verdict.worst],
        "windows": [s.to_dict() for s in scores],
        "served_model_name": cfg.served_model_name,
        "url": cfg.url,
        "served_by": cfg.served_by,
        "reference": {"id": cfg.reference_id, "top_k": reference.top_k,
                      "teacher": reference.metadata.get("teacher", {}),
                      "prompt": reference.metadata.get("prompt", {}),
                      "windows": len(reference.windows), "positions": reference.positions},
        "elapsed_s": round(elapsed_s, 3),
    }


def run_gate(cfg: GateConfig, reference: ReferenceSet, io: GateIO) -> GateOutcome:
    start = io.clock()
    headers = dict(api_headers(cfg.api_key), **{"Content-Type": "application/json"})
    scores: List[WindowScore] = []
    for window in reference.windows:
        body = json.dumps(completion_request(window, cfg.served_model_name, reference.top_k)).encode()
        answer = io.http("POST", cfg.url.rstrip("/") + "/v1/completions", headers, body, cfg.request_timeout)
        if answer.status != 200:
            return GateOutcome(True, "window %s: /v1/completions answered %s" % (
                window.id, answer.describe() if answer.status == 0 else "HTTP %d: %s" % (
                    answer.status, answer.body[:BODY_LIMIT])))
        try:
            scores.append(score_window(window, parse_served_window(answer.body, window, reference.top_k)))
        except QualityError as exc:
            return GateOutcome(True, str(exc))
    verdict = judge(scores, cfg.thresholds, cfg.worst_count)
    report = build_report(cfg, reference, verdict, scores, io.now_iso(), io.clock() - start)
    return GateOutcome(not verdict.passed, verdict_message(verdict), report)


def reusable_pass(report: Any, cfg: GateConfig) -> bool:
    """A report that already passed this exact gate against these same running ranks. The engine is deterministic
    and nothing it serves with can change without a restart (which gives a new ``served_by``), so measuring again
    would repeat the same numbers; a failed report, another set, other thresholds or new ranks are measured."""
    if not isinstance(report, Mapping) or not cfg.served_by or not cfg.reference_id:
        return False
    reference = report.get("reference")
    return (report.get("format") == REPORT_FORMAT and report.get("passed") is True
            and report.get("served_by") == cfg.served_by
            and isinstance(reference, Mapping) and reference.get("id") == cfg.reference_id
            and report.get("served_model_name") == cfg.served_model_name and report.get("url") == cfg.url
            and report.get("max_kld") == cfg.thresholds.max_kld and report.get("min_top1") == cfg.thresholds.min_top1)


def read_report(path: str) -> Optional[Dict[str, Any]]:
    """The report at ``path``, or None when there is none or it cannot be read as one."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_report(path: str, report: Mapping[str, Any]) -> None:
    """Atomically, so status.yml never reads half a report."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".quality-", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(report, handle, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
