"""Per-kernel GPU time of one MoE apply (CUPTI through torch.profiler): where our decode path's time goes.

Times our K=4 mcg kernels and exllamav3's `exl3_moe_coop` at decode sizes on the GLM-5.3 Flash rank
shape, over rotating routing sets, and prints the mean device time per call of each kernel. Ours run
without programmatic dependent launch here: with it, down and combine start early and wait inside
the kernel, so their device time would include the wait. Kernel time excludes the gaps between
launches; bench_moe.py measures the whole call.

    cd overlay/benchmarks && PYTHONPATH=../src python3 kernel_times.py --out results
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench_moe import SETS, SHAPE, coop_chunked, parse_args
from glm53_overlay.exl3 import gpu_checks, mcg4_moe

CALLS = 64


def kernel_means(fn, sets) -> dict[str, float]:
    """Mean device µs per call of each kernel fn launches."""
    for args in sets:
        fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:80]] += event.device_time
    return {name: us / CALLS for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def short_name(kernel: str) -> str:
    """`void ns::name<args>(params)` -> `name<args>`, at most 48 characters."""
    name = kernel.removeprefix("void ").replace("(anonymous namespace)::", "").split("(")[0]
    return name.rsplit("::", 1)[-1][:48]


def main() -> int:
    args = parse_args((1, 2, 4, 8))
    layer = gpu_checks.make_layer(SHAPE)
    gen = torch.Generator().manual_seed(7)
    report = {"device": torch.cuda.get_device_name(), "calls": CALLS, "rows": []}
    for tokens in args.tokens:
        sets = [gpu_checks.random_routing(SHAPE, tokens, gen, "cuda") for _ in range(SETS)]
        shape = dataclasses.replace(mcg4_moe.launch_shape(tokens), pdl=False)
        ours = (lambda x, i, w, s=shape: layer.ours.apply(x, i, w, s)) if layer.ours else layer.apply
        for name, fn in (("ours", ours), ("exl3_moe_coop", lambda x, i, w: coop_chunked(layer, x, i, w))):
            means = kernel_means(fn, sets)
            report["rows"].append({"tokens": tokens, "path": name, "kernels_us": means, "sum_us": sum(means.values())})
            print(f"T={tokens:<3} {name:<14} sum {sum(means.values()):7.1f} us  " +
                  "  ".join(f"{short_name(k)} {v:.1f}" for k, v in means.items()))
    (args.out / "kernel_times.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
