"""Pick the launch shape of our K=4 mcg decode kernels per token count (mcg4_moe.TUNED_SHAPES).

For each token count, times every LaunchShape (warps per block of gate/up and of down) as CUDA-graph replays over rotating routing sets on the GLM-5.3 Flash rank shape, checks
each against the exact reference, and prints the fastest next to exllamav3's exl3_moe_coop.

    cd overlay/benchmarks && PYTHONPATH=../src python3 tune_mcg4.py --out results
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys

import torch

from bench_moe import SETS, SHAPE, coop_chunked, parse_args, time_graph
from glm53_overlay.exl3 import gpu_checks, mcg4_moe


def main() -> int:
    args = parse_args((1, 2, 4, 8, 16))
    layer = gpu_checks.make_layer(SHAPE)
    dense = gpu_checks.dense_weights(layer)
    ours = layer.ours or mcg4_moe.Mcg4Experts(layer.gate, layer.up, layer.down, act_limit=layer.act_limit)
    gen = torch.Generator().manual_seed(7)
    rows = []
    for tokens in args.tokens:
        sets = [gpu_checks.random_routing(SHAPE, tokens, gen, "cuda") for _ in range(SETS)]
        x0, ids0, w0 = sets[0]
        ref = gpu_checks.reference_moe(dense, x0.half(), ids0, w0, SHAPE.act_limit)
        coop_us = time_graph(lambda x, i, w: coop_chunked(layer, x, i, w), sets)
        timed = []
        for gu_warps, d_warps in itertools.product(mcg4_moe.WARP_CHOICES, mcg4_moe.WARP_CHOICES):
            shape = mcg4_moe.LaunchShape(gu_warps, d_warps)
            err = gpu_checks.rel_err(ours.apply(x0, ids0, w0, shape), ref)
            us = time_graph(lambda x, i, w, s=shape: ours.apply(x, i, w, s), sets)
            timed.append({"tokens": tokens, "shape": shape.__dict__, "graph_us": us, "rel_err": err,
                          "coop_us": coop_us})
        best = min(timed, key=lambda r: r["graph_us"])
        no_pdl = dataclasses.replace(mcg4_moe.LaunchShape(**best["shape"]), pdl=False)
        no_pdl_us = time_graph(lambda x, i, w, s=no_pdl: ours.apply(x, i, w, s), sets)
        timed.append({"tokens": tokens, "shape": no_pdl.__dict__, "graph_us": no_pdl_us, "coop_us": coop_us,
                      "rel_err": gpu_checks.rel_err(ours.apply(x0, ids0, w0, no_pdl), ref)})
        rows.extend(timed)
        print(f"T={tokens:<3} coop {coop_us:7.1f} us  best {best['graph_us']:7.1f} us {best['shape']} "
              f"err {best['rel_err']:.1e}  speedup {coop_us / best['graph_us']:.2f}x  (same without PDL {no_pdl_us:.1f} us)")
        worst_err = max(r["rel_err"] for r in timed)
        if not worst_err <= gpu_checks.MOE_REL_TOL:
            print(f"  FAIL: a shape's rel err {worst_err:.2e} exceeds {gpu_checks.MOE_REL_TOL}")
            return 1
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    (args.out / "tune_mcg4.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
