"""Where our prefill MoE path (exl3/prefill_moe.py) spends its time: the whole apply, the decode alone and the
GEMMs alone (decode skipped, the scratch reused), per GEMM backend (torch._grouped_mm on fp16, or one
strided-batched GEMM over padded rows) and tile size, at GLM-5.3 Flash's TP=2 rank shape.

    GLM53_EXL3_MOE_DECODE=exllamav3 PYTHONPATH=overlay/src python3 overlay/benchmarks/prefill_gemm_probe.py --out DIR
"""

from __future__ import annotations

import json
import sys

import torch

from bench_moe import SETS, parse_args, prefill_decode_only, time_eager
from glm53_overlay.exl3 import gpu_checks, prefill_moe

SHAPE = gpu_checks.GLM53_FLASH_RANK


def main() -> int:
    args = parse_args((512, 2048, 4096))
    layer = gpu_checks.make_layer(SHAPE)
    dense = gpu_checks.dense_weights(layer)
    gen = torch.Generator().manual_seed(7)
    rows = []
    for tokens in args.tokens:
        sets = [gpu_checks.random_routing(SHAPE, tokens, gen, "cuda") for _unused in range(SETS // 4)]
        x0, ids0, w0 = sets[0]
        ref = gpu_checks.reference_moe(dense, x0.half(), ids0, w0, SHAPE.act_limit)
        for tile in (16, 64):
            for gemm in ("grouped_mm", "bmm_padded"):
                pre = prefill_moe.PrefillExperts(layer.gate, layer.up, layer.down, codebook=SHAPE.codebook,
                                                 ext=layer.ext, act_limit=SHAPE.act_limit, tile_experts=tile)
                pre.gemm = gemm
                err = gpu_checks.rel_err(pre.apply(x0.half(), ids0, w0), ref)
                whole = time_eager(lambda x, i, w, pre=pre: pre.apply(x.half(), i, w), sets)
                decode = time_eager(lambda x, i, w, pre=pre: prefill_decode_only(pre, x, i, w), sets)
                # GEMMs and glue alone: the decode is skipped and the scratch's last weights reused.
                pre._decode = lambda name, experts, count, pre=pre: pre.scratch()[name][:count]
                gemm_only = time_eager(lambda x, i, w, pre=pre: pre.apply(x.half(), i, w), sets)
                row = {"tokens": tokens, "tile_experts": tile, "gemm": gemm, "whole_us": whole, "decode_only_us": decode,
                       "gemm_and_glue_us": gemm_only, "rel_err_vs_exact": err}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del pre
                torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    (args.out / "prefill_gemm_probe.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
