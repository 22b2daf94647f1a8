"""Where the EXL3 decode time goes at 1-8 tokens: memory, trellis decode or launches (measured, not read).

Same layer and timing as bench_moe.py (one GLM-5.3 Flash TP=2 rank, graph replays over 16 rotating
routing sets). Each variant removes one cost and keeps the others:
- baseline: K=4, rotating routing (each call reads experts from HBM);
- warm: K=4, one fixed routing set (the same 8*T experts every call, mostly L2/HBM-row-buffer friendly):
  if memory were the limit this would be much faster;
- K=2: half the packed bytes, the same number of weights to decode: memory-bound kernels would halve;
- bytes-only: a gather-copy of exactly the packed bytes the routed experts occupy (the memory cost);
- launch-only: a graph of the same number of (empty) kernel launches as the coop path.

    PYTHONPATH=overlay/src python3 overlay/benchmarks/breakdown.py --out overlay/benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from bench_moe import SETS, copy_bandwidth, time_graph
from glm53_overlay.exl3 import gpu_checks

TOKENS = (1, 2, 4, 8)
SHAPE = gpu_checks.GLM53_FLASH_RANK


def routed_bytes_copy(layer, sets):
    """A closure copying every routed expert's packed trellis/suh/svh into a scratch buffer (index_select)."""
    projections = layer.projections().values()
    scratch = {}

    def copy(x, ids, w):
        experts = ids.reshape(-1)
        for i, p in enumerate(projections):
            for j, t in enumerate((p.trellis, p.suh, p.svh)):
                key = (i, j, experts.numel())
                if key not in scratch:
                    scratch[key] = torch.empty((experts.numel(), *t.shape[1:]), dtype=t.dtype, device=t.device)
                torch.index_select(t, 0, experts, out=scratch[key])
        return None

    return copy


def empty_launches(count: int):
    buf = torch.zeros(1, device="cuda")

    def launch(x, ids, w):
        for _ in range(count):
            buf.add_(0)
        return None

    return launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    k4 = gpu_checks.make_layer(SHAPE)
    k2 = gpu_checks.make_layer(dataclasses.replace(SHAPE, bits=2), seed=1)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for tokens in TOKENS:
        sets = [gpu_checks.random_routing(SHAPE, tokens, gen, "cuda") for _ in range(SETS)]
        fixed = [sets[0]] * SETS
        distinct = sum(int(ids.unique().numel()) for _, ids, _ in sets) / SETS
        expert_bytes = sum(p.expert_bytes() for p in k4.projections().values())
        row = {
            "tokens": tokens,
            "distinct_experts": distinct,
            "baseline_k4_us": time_graph(lambda x, i, w: k4.apply(x, i, w), sets),
            "warm_k4_us": time_graph(lambda x, i, w: k4.apply(x, i, w), fixed),
            "k2_us": time_graph(lambda x, i, w: k2.apply(x, i, w), sets),
            "bytes_only_us": time_graph(routed_bytes_copy(k4, sets), sets),
            "launch_only_us": time_graph(empty_launches(2), sets),
            "byte_floor_us": distinct * expert_bytes / bandwidth * 1e6,
        }
        rows.append(row)
        print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "exllamav3": gpu_checks.exllamav3_version(), "copy_bandwidth_Bps": bandwidth,
              "shape": dataclasses.asdict(SHAPE), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "breakdown.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
