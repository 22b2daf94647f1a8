# SPDX-License-Identifier: MIT
"""vllm_quality's gate: the top-k KL divergence against the full-vocabulary one it bounds, the cases a
renormalising or intersection-only implementation would pass, the reference format's refusals, the
verdict, and the run over a scripted API that answers like vLLM's /v1/completions."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import pytest

from ansible_collections.sparkops.glm53.plugins.module_utils import quality as q
from ansible_collections.sparkops.glm53.plugins.module_utils.health import HttpResult

K = 5


def log_softmax(logits: Sequence[float]) -> List[float]:
    top = max(logits)
    norm = top + math.log(math.fsum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


def full_kld(p_log: Sequence[float], q_log: Sequence[float]) -> float:
    return math.fsum(math.exp(a) * (a - b) for a, b in zip(p_log, q_log))


def topk(logprobs: Sequence[float], k: int) -> Tuple[List[int], List[float]]:
    order = sorted(range(len(logprobs)), key=lambda i: -logprobs[i])[:k]
    return order, [logprobs[i] for i in order]


def vllm_entry(logprobs: Sequence[float], k: int, prompt_token: Optional[int] = None) -> Dict[str, dict]:
    """One position of vLLM's prompt_logprobs: the top-k by rank plus the prompt's own token."""
    order = sorted(range(len(logprobs)), key=lambda i: -logprobs[i])
    entry = {str(t): {"logprob": logprobs[t], "rank": r + 1, "decoded_token": "t%d" % t}
             for r, t in enumerate(order[:k])}
    if prompt_token is not None and str(prompt_token) not in entry:
        entry[str(prompt_token)] = {"logprob": logprobs[prompt_token], "rank": order.index(prompt_token) + 1,
                                    "decoded_token": "t%d" % prompt_token}
    return entry


def served(logprobs: Sequence[float], k: int = K, prompt_token: Optional[int] = None) -> q.ServedPosition:
    return q.parse_served_position(vllm_entry(logprobs, k, prompt_token), k)


def teacher_row(logprobs: Sequence[float], k: int = K) -> Tuple[List[int], List[float]]:
    return topk(logprobs, k)


# --------------------------------------------------------------------------- one position


def test_identical_distributions_score_zero() -> None:
    p = log_softmax([3.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])
    ids, lps = teacher_row(p)
    assert q.position_kld(ids, lps, served(p)) == pytest.approx(0.0, abs=1e-12)


def test_right_top1_but_mass_leaked_to_the_tail_raises_the_kld_where_renormalising_would_not() -> None:
    # Same order and the same ratios inside the top-k, but the served model puts half of that mass on
    # the rest of the vocabulary: a flattened distribution, as a wrong scale or a broken kernel gives.
    teacher = log_softmax([6.0, 5.0, 4.0, 3.0, 2.0] + [-4.0] * 20)
    top_mass = math.fsum(math.exp(x) for x in teacher[:5])
    leaked = [x + math.log(0.5) for x in teacher[:5]]
    rest = log_softmax([0.0] * 20)
    tail = [x + math.log(1 - 0.5 * top_mass) for x in rest]
    served_log = leaked + tail
    ids, lps = teacher_row(teacher)
    kld = q.position_kld(ids, lps, served(served_log))
    # A wrong implementation: renormalise both over the shared tokens, which compares shapes only.
    shared = [math.exp(x) for x in lps]
    s_shared = [math.exp(served_log[i]) for i in ids]
    naive = math.fsum(a / sum(shared) * math.log((a / sum(shared)) / (b / sum(s_shared)))
                      for a, b in zip(shared, s_shared))
    assert naive == pytest.approx(0.0, abs=1e-12)
    assert served(served_log).top[0] == ids[0]
    assert kld > 0.3
    assert kld <= full_kld(teacher, served_log) + 1e-9


def test_teacher_tokens_missing_from_the_served_top_k_count_at_most_at_its_cap() -> None:
    # The served model ranks the teacher's whole top-k below its own top-k: an intersection-only
    # implementation has nothing to compare and scores 0; the cap says the served mass there is tiny.
    vocab = 40
    teacher = log_softmax([8.0 - i for i in range(5)] + [-5.0] * (vocab - 5))
    served_log = log_softmax([-5.0] * 5 + [8.0 - i for i in range(5)] + [-5.0] * (vocab - 10))
    ids, lps = teacher_row(teacher)
    position = served(served_log)
    assert not set(ids) & set(position.top)
    kld = q.position_kld(ids, lps, position)
    # log(p / cap) for the teacher's 0.63 top-1 against the served 5th-ranked 0.01 alone is over 4 nats.
    assert kld > 3.0
    assert kld <= full_kld(teacher, served_log) + 1e-9


def test_a_degenerate_engine_that_always_says_eos_scores_tens_of_nats() -> None:
    vocab, eos = 64, 3
    teacher = log_softmax([5.0 if i == 10 else (2.0 if i in (11, 12) else 0.0) for i in range(vocab)])
    served_log = log_softmax([45.0 if i == eos else 0.0 for i in range(vocab)])
    ids, lps = teacher_row(teacher)
    assert q.position_kld(ids, lps, served(served_log)) > 20.0


@pytest.mark.parametrize("seed", range(40))
def test_never_above_the_full_vocabulary_kld_and_exact_when_everything_is_listed(seed: int) -> None:
    rng = random.Random(seed)
    vocab = 30
    teacher = log_softmax([rng.gauss(0, 2.5) for _token in range(vocab)])
    # A perturbed student: close for small noise, far for large.
    noise = rng.choice([0.05, 0.5, 3.0])
    student = log_softmax([x + rng.gauss(0, noise) for x in teacher])
    truth = full_kld(teacher, student)
    for k_teacher, k_served in ((5, 5), (5, 10), (10, 3)):
        ids, lps = teacher_row(teacher, k_teacher)
        assert q.position_kld(ids, lps, served(student, k_served)) <= truth + 1e-9
    ids, lps = teacher_row(teacher, vocab)
    assert q.position_kld(ids, lps, served(student, vocab)) == pytest.approx(truth, rel=1e-9, abs=1e-12)


def test_disjoint_top_k_scores_what_the_served_listed_mass_forces() -> None:
    # Teacher {a: 0.5, c: 0.4}, served {b: 0.6, d: 0.3}: b and d are in the teacher's rest, so the served side
    # has at most 0.1 left for a and c. The KL over {a, c, rest} is then at least 0.8 ln 9 = 1.758 nats; a bound
    # that lets a and c take the served cap each (0.3 + 0.3) says 0.232.
    a, b, c, d = 0, 1, 2, 3
    position = q.ServedPosition({b: math.log(0.6), d: math.log(0.3)}, (b, d))
    kld = q.position_kld([a, c], [math.log(0.5), math.log(0.4)], position)
    assert kld == pytest.approx(0.8 * math.log(9), rel=1e-9)
    assert kld >= 1.75


def _partition_kld(p: Sequence[float], p_rest: float, x: Sequence[float], q_rest: float) -> float:
    rest = p_rest * math.log(p_rest / q_rest) if p_rest else 0.0
    return math.fsum(a * math.log(a / b) for a, b in zip(p, x)) + rest


def _brute_force_minimum(ids: Sequence[int], lps: Sequence[float], position: q.ServedPosition) -> float:
    """The smallest partition KL over a grid of every served distribution the reports allow, written from the
    constraints alone (no multiplier, no water-filling): one or two teacher tokens missing from the served list."""
    p = [math.exp(lp) for lp in lps]
    p_rest = max(0.0, 1.0 - math.fsum(p))
    known = [(p_t, math.exp(position.logprobs[t])) for t, p_t in zip(ids, p) if t in position.logprobs]
    missing = [p_t for t, p_t in zip(ids, p) if t not in position.logprobs]
    others = math.fsum(math.exp(lq) for t, lq in position.logprobs.items() if t not in ids)
    cap = min(math.exp(position.logprobs[t]) for t in position.top)
    budget = 1.0 - math.fsum(q_t for _p, q_t in known)
    fixed = math.fsum(p_t * math.log(p_t / q_t) for p_t, q_t in known)
    steps = 240
    grid = [math.exp(math.log(1e-12) * (1 - i / steps)) for i in range(steps + 1)]  # 1e-12 .. 1, log-spaced
    best = math.inf
    for share in grid:  # q_rest = others + share of what is above it
        q_rest = others + share * (budget - others)
        left = budget - q_rest
        if len(missing) == 1:
            candidates = [[left]]
        else:
            # Splits near either end, log-spaced: f and 1 - f for every grid value.
            splits = grid[1:-1] + [1 - g for g in grid[1:-1]]
            candidates = [[f * left, (1 - f) * left] for f in splits]
        for x in candidates:
            if all(0 < v <= cap * (1 + 1e-12) for v in x) and (q_rest > 0 or p_rest == 0):
                best = min(best, fixed + _partition_kld(missing, p_rest, x, max(q_rest, 1e-300)))
    return best


def _adversarial_cases() -> List[Tuple[str, List[int], List[float], q.ServedPosition]]:
    cases = []
    # Partially overlapping: the teacher's second and third tokens are not in the served top-3.
    teacher = log_softmax([4.0, 3.0, 2.5, 0.0, -1.0, -1.0, -2.0, -3.0])
    student = log_softmax([4.0, -3.0, -3.5, 3.5, 3.0, -1.0, -2.0, -3.0])
    cases.append(("partial", *topk(teacher, 3), served(student, 3)))
    # Flat teacher, peaked student elsewhere.
    teacher = log_softmax([0.1 * i for i in range(12)])
    student = log_softmax([6.0 if i == 0 else 0.0 for i in range(12)])
    cases.append(("flat-vs-peaked", *topk(teacher, 2), served(student, 3)))
    # Peaked teacher, the student lists its top token and one other.
    teacher = log_softmax([7.0, 1.0, 0.5] + [0.0] * 9)
    student = log_softmax([1.0, 5.0, 4.0] + [0.0] * 9)
    cases.append(("peaked", *topk(teacher, 2), served(student, 2)))
    rng = random.Random(7)
    for seed in range(8):
        teacher = log_softmax([rng.gauss(0, 2.0) for _token in range(10)])
        student = log_softmax([rng.gauss(0, 2.0) for _token in range(10)])
        k_served = rng.choice([2, 3, 4])
        ids, lps = topk(teacher, rng.choice([2, 3]))
        position = served(student, k_served)
        if 1 <= sum(t not in position.logprobs for t in ids) <= 2:
            cases.append(("random-%d" % seed, ids, lps, position))
    return cases


@pytest.mark.parametrize("case", _adversarial_cases(), ids=lambda case: case[0])
def test_the_bound_is_the_minimum_over_what_both_reports_allow(case) -> None:
    _name, ids, lps, position = case
    kld = q.position_kld(ids, lps, position)
    brute = _brute_force_minimum(ids, lps, position)
    # Never above the exact minimum (the grid only finds values at or above it), and the grid comes close to it.
    assert kld <= brute + 1e-9
    assert brute - kld <= 0.02 + 0.01 * kld, (kld, brute)


def test_the_prompt_token_listed_beyond_the_top_k_does_not_lower_the_cap() -> None:
    logprobs = log_softmax([4.0, 3.0, 2.0, 1.0, 0.0, -6.0, -7.0])
    position = served(logprobs, k=3, prompt_token=6)
    assert position.top == (0, 1, 2)
    assert set(position.logprobs) == {0, 1, 2, 6}


def test_served_values_are_not_renormalised_mass_is_read_as_reported() -> None:
    position = q.parse_served_position({"7": {"logprob": -0.5, "rank": 1}, "9": {"logprob": -2.0, "rank": 2}}, 2)
    assert position.logprobs == {7: -0.5, 9: -2.0} and position.top == (7, 9)


# --------------------------------------------------------------------------- the reference format


def window_dict(window_id: str = "w0", tokens: Sequence[int] = (1, 2, 3, 4), scored_from: int = 1,
                k: int = 2) -> Dict[str, object]:
    rows = len(tokens) - scored_from
    return {"id": window_id, "kind": "text", "token_ids": list(tokens), "scored_from": scored_from,
            "top_ids": [[5, 6][:k] + list(range(10, 10 + k - 2)) for _row in range(rows)],
            "top_logprobs": [[-0.2, -2.0][:k] + [-9.0] * (k - 2) for _row in range(rows)]}


def metadata(k: int = 2) -> Dict[str, object]:
    return {"format": q.REFERENCE_FORMAT, "version": q.REFERENCE_VERSION, "top_k": k}


def test_a_valid_set_parses_with_its_position_count() -> None:
    ref = q.parse_reference(metadata(), [json.dumps(window_dict("a")), "", json.dumps(window_dict("b"))], "x")
    assert [w.id for w in ref.windows] == ["a", "b"] and ref.positions == 6 and ref.top_k == 2


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda d: d.update(scored_from=0), "scored_from 0 outside 1..3"),
        (lambda d: d["top_ids"].pop(), "need 3 rows"),
        (lambda d: d["top_ids"].__setitem__(0, [5, 5]), "row 0 must hold 2 distinct ids"),
        (lambda d: d["top_logprobs"].__setitem__(1, [0.5, -1.0]), "row 1 is not full-vocabulary"),
        (lambda d: d["top_logprobs"].__setitem__(2, [-0.1, -0.2]), "row 2 is not full-vocabulary"),
        (lambda d: d.pop("token_ids"), "not a reference window"),
    ],
)
def test_malformed_windows_are_refused_naming_the_line(change, needle: str) -> None:
    bad = window_dict()
    change(bad)
    with pytest.raises(q.QualityError, match="set line 2") as err:
        q.parse_reference(metadata(), [json.dumps(window_dict("ok")), json.dumps(bad)], "set")
    assert needle in str(err.value)


def test_a_set_of_another_format_or_without_windows_is_refused() -> None:
    with pytest.raises(q.QualityError, match="this gate reads sparkops-glm53-quality-reference version 1"):
        q.parse_reference({"format": "other", "version": 1, "top_k": 2}, [json.dumps(window_dict())], "set")
    with pytest.raises(q.QualityError, match="holds no windows"):
        q.parse_reference(metadata(), [], "set")
    with pytest.raises(q.QualityError, match="not unique"):
        q.parse_reference(metadata(), [json.dumps(window_dict("a"))] * 2, "set")


def test_load_reference_reads_the_directory_and_names_a_missing_one(tmp_path: Path) -> None:
    (tmp_path / "reference.json").write_text(json.dumps({**metadata(), "windows_file": "w.jsonl"}))
    (tmp_path / "w.jsonl").write_text(json.dumps(window_dict()) + "\n")
    assert q.load_reference(str(tmp_path)).positions == 3
    with pytest.raises(q.QualityError, match="cannot read the reference set in"):
        q.load_reference(str(tmp_path / "absent"))


# --------------------------------------------------------------------------- windows, verdict, run


def make_window(window_id: str, teacher_rows: Sequence[Sequence[float]], k: int = K) -> q.Window:
    tokens = tuple(range(100, 101 + len(teacher_rows)))
    rows = [teacher_row(r, k) for r in teacher_rows]
    return q.Window(window_id, tokens, 1, tuple(tuple(i) for i, _values in rows), tuple(tuple(v) for _ids, v in rows), "text")


def completion_body(window: q.Window, served_rows: Sequence[Sequence[float]], k: int = K) -> str:
    entries: List[Optional[dict]] = [None] + [vllm_entry(r, k, window.token_ids[i + 1] % len(r))
                                              for i, r in enumerate(served_rows)]
    return json.dumps({"choices": [{"text": "x", "prompt_logprobs": entries}]})


def rows(seed: int, count: int = 4, vocab: int = 20) -> List[List[float]]:
    rng = random.Random(seed)
    return [log_softmax([rng.gauss(0, 3) for _token in range(vocab)]) for _row in range(count)]


def test_window_score_names_its_worst_position_and_top1_agreement() -> None:
    teacher = rows(1)
    student = [list(r) for r in teacher]
    student[2] = list(reversed(student[2]))
    window = make_window("w", teacher)
    score = q.score_window(window, q.parse_served_window(completion_body(window, student), window, K))
    assert score.worst_position == 3 and score.top1 == 0.75 and score.kld > 0
    assert score.teacher_top1 != score.served_top1


def test_judge_weights_by_positions_and_names_both_thresholds() -> None:
    scores = [q.WindowScore("a", "", 10, 0.01, 1.0, 0.1, 1, 0, 0), q.WindowScore("b", "", 30, 0.5, 0.5, 2.0, 1, 0, 1)]
    verdict = q.judge(scores, q.Thresholds(max_kld=0.1, min_top1=0.9), worst_count=1)
    assert verdict.kld == pytest.approx((0.1 + 15) / 40) and verdict.top1 == pytest.approx(0.625)
    assert not verdict.passed and [s.id for s in verdict.worst] == ["b"]
    message = q.verdict_message(verdict)
    assert "mean KLD 0.3775 nats > max_kld 0.1" in message and "top-1 agreement 0.6250 < min_top1 0.9" in message
    assert "worst windows: b (KLD 0.5000, top-1 0.50)" in message
    assert q.judge(scores, q.Thresholds(1.0, 0.5)).passed
    # NaN never passes.
    nan = [q.WindowScore("n", "", 1, float("nan"), 1.0, 0.0, 1, 0, 0)]
    assert not q.judge(nan, q.Thresholds(1.0, 0.0)).passed


class ScriptedApi:
    def __init__(self, answers: Mapping[str, HttpResult]) -> None:
        self.answers = answers
        self.requests: List[dict] = []

    def __call__(self, method: str, url: str, headers: Mapping[str, str], body: Optional[bytes],
                 timeout: float) -> HttpResult:
        request = json.loads(body or b"{}")
        self.requests.append({"url": url, "headers": dict(headers), **request})
        return self.answers[str(request["prompt"][:3])]


def gate(answers: Mapping[str, HttpResult], windows: Sequence[q.Window], max_kld: float = 0.05,
         api_key: Optional[str] = None) -> Tuple[q.GateOutcome, ScriptedApi]:
    ref = q.ReferenceSet({"format": q.REFERENCE_FORMAT, "version": 1, "top_k": K,
                          "teacher": {"repo": "sim/tiny-glm"}}, tuple(windows))
    api = ScriptedApi(answers)
    ticks = iter(range(100))
    cfg = q.GateConfig("http://head:8888/", "M", q.Thresholds(max_kld, 0.9), api_key=api_key, reference_id="r@1")
    return q.run_gate(cfg, ref, q.GateIO(api, lambda: float(next(ticks)), lambda: "T")), api


def test_run_sends_token_ids_with_prompt_logprobs_and_passes_a_faithful_server() -> None:
    good, other = rows(2), rows(3)
    w1 = make_window("w1", good)
    w2 = q.Window("w2", (7, 8, 9, 10, 11), 1, make_window("x", other).top_ids, make_window("x", other).top_logprobs)
    answers = {str([100, 101, 102]): HttpResult(200, completion_body(w1, good)),
               str([7, 8, 9]): HttpResult(200, completion_body(w2, other))}
    outcome, api = gate(answers, [w1, w2], api_key="sekret")
    assert not outcome.failed, outcome.msg
    assert api.requests[0]["url"] == "http://head:8888/v1/completions"
    assert api.requests[0]["prompt"] == list(w1.token_ids) and api.requests[0]["prompt_logprobs"] == K
    assert api.requests[0]["max_tokens"] == 1 and api.requests[0]["model"] == "M"
    assert api.requests[0]["headers"]["Authorization"] == "Bearer sekret"
    report = outcome.report
    assert report["passed"] and report["kld"] == pytest.approx(0.0, abs=1e-9) and report["top1"] == 1.0
    assert report["positions"] == 8 and [w["id"] for w in report["windows"]] == ["w1", "w2"]
    assert report["reference"]["id"] == "r@1" and report["time"] == "T"
    json.dumps(report)


def test_run_fails_a_server_that_is_fluent_but_flattened_naming_kld_threshold_and_window() -> None:
    teacher = rows(4)
    flattened = [log_softmax([x * 0.4 for x in r]) for r in teacher]
    window = make_window("chat-007", teacher)
    outcome, _api = gate({str([100, 101, 102]): HttpResult(200, completion_body(window, flattened))}, [window])
    assert outcome.failed and outcome.report["top1"] == 1.0
    assert "> max_kld 0.05" in outcome.msg and "chat-007 (KLD" in outcome.msg


@pytest.mark.parametrize(
    "answer,needle",
    [
        (HttpResult(400, '{"error": "prompt_logprobs 5 > max_logprobs 2"}'), "HTTP 400: {\"error\": \"prompt_logprobs"),
        (HttpResult(0, "", "ConnectionRefusedError: refused"), "ConnectionRefusedError"),
        (HttpResult(200, '{"choices": [{"text": "x"}]}'), "no choices[0].prompt_logprobs"),
        (HttpResult(200, '{"choices": [{"prompt_logprobs": [null, {}]}]}'), "2 prompt_logprobs entries for 5"),
    ],
)
def test_a_request_the_gate_cannot_score_fails_with_the_evidence(answer: HttpResult, needle: str) -> None:
    window = make_window("w", rows(5))
    outcome, _api = gate({str([100, 101, 102]): answer}, [window])
    assert outcome.failed and needle in outcome.msg and "window w" in outcome.msg and not outcome.report


def test_write_report_replaces_the_file_atomically(tmp_path: Path) -> None:
    path = tmp_path / "quality" / "last.json"
    q.write_report(str(path), {"passed": True})
    q.write_report(str(path), {"passed": False})
    assert json.loads(path.read_text()) == {"passed": False}
    assert [p.name for p in path.parent.iterdir()] == ["last.json"]


def test_reusable_pass_needs_every_identity_to_match() -> None:
    cfg = q.GateConfig("http://head:8888", "M", q.Thresholds(0.08, 0.9), reference_id="r@1", served_by="c@T")
    report = {"format": q.REPORT_FORMAT, "passed": True, "served_by": "c@T", "reference": {"id": "r@1"},
              "served_model_name": "M", "url": "http://head:8888", "max_kld": 0.08, "min_top1": 0.9}
    assert q.reusable_pass(report, cfg)
    for change in ({"passed": False}, {"served_by": "c@T2"}, {"reference": {"id": "r@2"}}, {"max_kld": 0.1},
                   {"min_top1": 0.8}, {"url": "http://head:8889"}, {"served_model_name": "N"}, {"format": "x"},
                   {"reference": None}):
        assert not q.reusable_pass(dict(report, **change), cfg), change
    assert not q.reusable_pass(report, q.GateConfig("http://head:8888", "M", q.Thresholds(0.08, 0.9),
                                                    reference_id="r@1"))
    assert not q.reusable_pass(["not", "a", "report"], cfg)


def test_read_report_returns_none_for_what_is_not_a_report(tmp_path: Path) -> None:
    assert q.read_report(str(tmp_path / "absent.json")) is None
    (tmp_path / "bad.json").write_text("{not json")
    assert q.read_report(str(tmp_path / "bad.json")) is None
    (tmp_path / "list.json").write_text("[1]")
    assert q.read_report(str(tmp_path / "list.json")) is None
