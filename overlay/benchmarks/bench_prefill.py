"""Prefill MoE: the engine's path against exllamav3 1.6.5's own prefill plan, at 512-8192 tokens, random and
skewed routing. One GLM-5.3 Flash MoE layer as a TP=2 rank sees it (bench_moe.SHAPE).

Paths, each run on the same rotating inputs:
- engine: `Exl3CudaExperts.apply`, what vLLM calls (its `kernels` field names the path it took);
- ours_syncfree: our prefill path alone (`prefill_moe.PrefillExperts.apply`: every expert decoded a tile at a
  time, Triton grouped GEMMs, no host sync), in the formulation the engine uses (prefill_moe.UNFOLDED);
- ours_syncfree_folded: the same with the other formulation (the folded one, the engine's path before issue 27's
  second round, or the unfolded one if the engine is folded);
- ours_plan: exllamav3's plan with our GEMMs for the heavy experts (`apply_fused`: exl3_moe for experts with
  <= 128 rows, `apply_experts` above);
- exllamav3_plan: exllamav3 1.6.5's own plan as its BlockSparseMLP.forward dispatches it on the GPU for an mcg
  layer: one host read of the counts, exl3_moe for the experts with <= 128 rows (EXL3_MOE_FUSED_ROWS, the
  default), and its batched reconstruct tier for the heavier ones (`moe_batch_recon.plan_groups` and
  `BatchReconLayer.run_group`, loaded from the installed exllamav3 1.6.5 package, default settings: groups of
  up to 16 experts, folded reconstruct, one strided-batched fp16 GEMM per projection). Accumulation is the
  atomic one (EXL3_MOE_FUSED_DET=0), the faster of its two modes;
- exl3_moe_alone: exl3_moe for the light experts, one exl3_gemm per projection per heavy expert (the baseline
  the old "1.29x" was measured against);
- bf16_grouped_mm: the experts dequantized to bf16, torch._grouped_mm (bench_moe.Bf16GroupedMoE), for scale.

Timing: CUDA events around each call (the host launches inside, so host-bound paths show it), median of REPS
calls over SETS rotating input sets after warm-up, the paths taking turns call by call; sync-free paths also as
CUDA-graph replays (GPU-busy time).
Error: ||out - ref|| / ||ref|| against an fp32 MoE over the reference decoder's exact weights, on every set.

    PYTHONPATH=overlay/src python3 overlay/benchmarks/bench_prefill.py --out overlay/benchmarks/results/prefill
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from bench_moe import SHAPE, Bf16GroupedMoE, parse_args, time_graph

from glm53_overlay.exl3 import gpu_checks, prefill_gemm, prefill_moe, runtime

TOKENS = (512, 1024, 2048, 4096, 7168, 8192)
ROUTINGS = ("random", "skewed")
# Skewed: expert popularity ~ 1 / rank^ZIPF (random ranks), top-k drawn without replacement (Gumbel top-k).
ZIPF = 1.0
SETS = 4
REPS = 12
WARMUP = 3
GRAPH_REPS = 5
# The folded formulation's tuned tile (results/prefill/dev/tune_prefill_run3.json).
FOLDED_TILE = 16


def routing_set(tokens: int, kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, ids, w = gpu_checks.random_routing(SHAPE, tokens, gen, "cuda")
    if kind == "skewed":
        rank = torch.randperm(SHAPE.experts, generator=gen).float() + 1
        logits = -ZIPF * torch.log(rank)
        gumbel = -torch.log(-torch.log(torch.rand((tokens, SHAPE.experts), generator=gen).clamp_min(1e-20)))
        ids = (logits + gumbel).topk(SHAPE.top_k, dim=1).indices.to("cuda")
    return x, ids, w


def load_exllamav3_batch_recon(ext):
    """exllamav3 1.6.5's moe_batch_recon module from the installed package, without importing the package's
    __init__ (it pulls in the whole model stack and its dependencies): the two modules it imports are given
    as the extension already loaded and exllamav3's own one-line host_to_device."""
    spec = importlib.util.find_spec("exllamav3")
    root = Path(spec.submodule_search_locations[0])
    for name in ("exllamav3", "exllamav3.modules", "exllamav3.util"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / name.partition(".")[2].replace(".", "/"))] if "." in name else [str(root)]
        sys.modules[name] = pkg
    sys.modules["exllamav3.ext"] = types.SimpleNamespace(exllamav3_ext=ext)
    sys.modules["exllamav3.util.device_copy"] = types.SimpleNamespace(
        host_to_device=lambda t, device: t.to(device, non_blocking=True))
    mspec = importlib.util.spec_from_file_location("exllamav3.modules.moe_batch_recon",
                                                   root / "modules" / "moe_batch_recon.py")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mspec.name] = module
    mspec.loader.exec_module(module)
    return module


class Exllamav3Plan:
    """exllamav3 1.6.5's GPU prefill dispatch for one MoE layer (see the module docstring)."""

    def __init__(self, layer: runtime.Exl3CudaExperts, recon_mod) -> None:
        self.layer, self.mod = layer, recon_mod
        g, u, d = layer.gate, layer.up, layer.down
        self.recon = recon_mod.BatchReconLayer(
            (g.in_features, g.out_features, g.bits), (u.in_features, u.out_features, u.bits),
            (d.in_features, d.out_features, d.bits), (layer.mcg, layer.mul1), (layer.mcg, layer.mul1),
            (layer.mcg, layer.mul1), "silu", layer.act_limit, layer.device,
            {"g": (g.suh, g.svh), "u": (u.suh, u.svh), "d": (d.suh, d.svh)})
        self.recon.set_static_pointers(layer.ptrs["gate"][0], layer.ptrs["up"][0], layer.ptrs["down"][0])

    def apply(self, x, ids, w):
        layer = self.layer
        y = x.half().contiguous()
        tokens = y.shape[0]
        expert_count, token_sorted, weight_sorted = runtime.routing_tables(ids, w, layer.num_experts)
        out_ext = torch.zeros((tokens + 1, layer.hidden), dtype=torch.float32, device=y.device)
        out = out_ext[:tokens]
        counts = expert_count.tolist()
        light = sum(1 for c in counts[: layer.num_experts] if 0 < c <= runtime.FUSED_ROWS)
        if light:
            layer._run_fused(y, out, expert_count, token_sorted, weight_sorted, num_active=light)
        heavy = [e for e in range(layer.num_experts) if runtime.FUSED_ROWS < counts[e] <= self.recon.max_rows]
        if heavy:
            y_ext = torch.cat([y, torch.zeros((1, y.shape[1]), dtype=y.dtype, device=y.device)])
            tok_ext = torch.cat([token_sorted, torch.full((1,), tokens, dtype=token_sorted.dtype, device=y.device)])
            w_ext = torch.cat([weight_sorted.half(), torch.zeros((1,), dtype=torch.half, device=y.device)])
            starts = [0]
            for c in counts:
                starts.append(starts[-1] + c)
            for grp in self.mod.plan_groups(heavy, lambda e: counts[e], self.recon.cap):
                self.recon.run_group(y_ext, out_ext, tok_ext, w_ext, grp, [starts[e] for e in grp],
                                     [counts[e] for e in grp])
        return out.to(x.dtype)


def time_eager(fns: dict, sets) -> dict[str, tuple[float, float]]:
    """Per path, (median event time per call, median host time to enqueue one call) in us. The paths take turns
    call by call, so clock and cache drift over the run falls on all of them alike (two paths running the same
    kernel, as the engine and exllamav3's plan do at 512-1024 random tokens, then differ by spread only)."""
    for i in range(WARMUP):
        for fn in fns.values():
            fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    host: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(REPS):
        args = sets[i % len(sets)]
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn(*args)
            host[name].append((time.perf_counter() - t0) * 1e6)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    return {name: (statistics.median(times[name]), statistics.median(host[name])) for name in fns}


def main() -> int:
    tuned = None
    if "--tuned" in sys.argv:
        # --tuned TUNE_JSON: run with tune_prefill.py's best settings (what the committed defaults are then set to).
        at = sys.argv.index("--tuned")
        tuned = json.loads(Path(sys.argv[at + 1]).read_text())["best"]
        del sys.argv[at : at + 2]
        import tune_prefill

        tune_prefill.apply_settings(tuned)
    args = parse_args(TOKENS)
    layer = gpu_checks.make_layer(SHAPE)
    assert layer.prefill is not None, "our prefill path is off (GLM53_EXL3_MOE_PREFILL or an old extension)"

    def formulation(unfolded: bool) -> prefill_moe.PrefillExperts:
        if not unfolded:
            tile, overlap = FOLDED_TILE, True  # as the folded formulation's own tune left it
        elif tuned is not None:
            tile, overlap = tuned["tile"], tuned["overlap"]
        else:
            tile, overlap = prefill_moe.tile_experts_setting(), True
        return prefill_moe.PrefillExperts(layer.gate, layer.up, layer.down, codebook=SHAPE.codebook, ext=layer.ext,
                                          act_limit=SHAPE.act_limit, tile_experts=tile, overlap=overlap,
                                          unfolded=unfolded)

    layer.prefill = formulation(prefill_moe.UNFOLDED)
    other = formulation(not prefill_moe.UNFOLDED)
    dense = gpu_checks.dense_weights(layer)
    bf16 = Bf16GroupedMoE(dense, SHAPE.act_limit)
    plan = Exllamav3Plan(layer, load_exllamav3_batch_recon(layer.ext))
    prefill = layer.prefill

    def exl3_moe_alone(x, i, w):
        layer.prefill = None
        try:
            return layer.apply_fused(x.half(), i, w).to(x.dtype)
        finally:
            layer.prefill = prefill

    paths = {
        "engine": (layer.apply, False),
        "ours_syncfree": (lambda x, i, w: prefill.apply(x.half(), i, w).to(x.dtype), True),
        "ours_syncfree_" + ("folded" if prefill.unfolded else "unfolded"):
            (lambda x, i, w: other.apply(x.half(), i, w).to(x.dtype), True),
        "ours_plan": (lambda x, i, w: layer.apply_fused(x.half(), i, w).to(x.dtype), False),
        "exllamav3_plan": (plan.apply, False),
        "exl3_moe_alone": (exl3_moe_alone, False),
        "bf16_grouped_mm": (bf16.apply, True),
    }
    gen = torch.Generator().manual_seed(11)
    rows = []
    for kind in ROUTINGS:
        for tokens in args.tokens:
            sets = [routing_set(tokens, kind, gen) for _ in range(SETS)]
            refs = [gpu_checks.reference_moe(dense, x.half(), i, w, SHAPE.act_limit) for x, i, w in sets]
            counts = [torch.bincount(i.reshape(-1), minlength=SHAPE.experts) for _, i, _ in sets]
            heavy = statistics.mean(int((c > runtime.FUSED_ROWS).sum()) for c in counts)
            touched = statistics.mean(int((c > 0).sum()) for c in counts)
            max_rows = max(int(c.max()) for c in counts)
            errs: dict[str, list[float]] = {}
            for name, (fn, _graphable) in paths.items():
                try:
                    errs[name] = [gpu_checks.rel_err(fn(*s), ref) for s, ref in zip(sets, refs)]
                except Exception as exc:
                    print(f"{kind} T={tokens} {name}: {type(exc).__name__}: {str(exc)[:300]}")
                    rows.append({"path": name, "tokens": tokens, "routing": kind, "error": f"{exc}"[:500]})
                    torch.cuda.synchronize()
            eager = time_eager({name: paths[name][0] for name in errs}, sets)
            for name, (event_us, host_us) in eager.items():
                fn, graphable = paths[name]
                graph_us = time_graph(fn, sets, GRAPH_REPS) if graphable else None
                row = {"path": name, "tokens": tokens, "routing": kind, "event_us": event_us, "host_us": host_us,
                       "graph_us": graph_us, "rel_err_max": max(errs[name]),
                       "rel_err_mean": statistics.mean(errs[name]), "heavy_experts": heavy,
                       "touched_experts": touched, "max_rows": max_rows}
                if name == "engine":
                    row["kernels"] = layer.path_for(tokens)
                rows.append(row)
                g = f"{graph_us:8.0f}" if graph_us is not None else "     n/a"
                print(f"{kind:<6} T={tokens:<5} {name:<16} {event_us:8.0f} us (host {host_us:7.0f}, graph {g})"
                      f"  err {max(errs[name]):.2e}", flush=True)
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": importlib.metadata.version("triton"), "python": platform.python_version(),
        "exllamav3": importlib.metadata.version("exllamav3"),
        "shape": {"hidden": SHAPE.hidden, "experts": SHAPE.experts, "top_k": SHAPE.top_k,
                  "intermediate_per_rank": SHAPE.intermediate, "bits": SHAPE.bits, "codebook": SHAPE.codebook,
                  "act_limit": SHAPE.act_limit},
        "prefill_tile_experts": prefill.tile, "prefill_overlap": prefill.overlap, "prefill_unfolded": prefill.unfolded,
        "gate_up_block": prefill_gemm.GATE_UP_BLOCK, "down_block": prefill_gemm.DOWN_BLOCK,
        "rot_gate_up_block": prefill_gemm.ROT_GATE_UP_BLOCK, "rot_down_block": prefill_gemm.ROT_DOWN_BLOCK,
        "persistent": prefill_gemm.PERSISTENT, "tuned_from": tuned, "engine_table": layer.prefill_measured,
        "method": f"CUDA events around each call, median of {REPS} after {WARMUP} warm-ups over {SETS} rotating sets, "
                  "the paths taking turns call by call; "
                  f"graph: {SETS} calls captured, median of {GRAPH_REPS} replays / {SETS}; host_us: time for the "
                  "call to return (launches; a host read waits for the GPU); skewed: Zipf popularity "
                  f"{ZIPF}, Gumbel top-k; errors vs fp32 MoE over exact weights, every set",
        "rows": rows,
    }
    (args.out / "bench_prefill.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    by = {(r["routing"], r["tokens"], r["path"]): r for r in report["rows"] if "event_us" in r}
    names = ("engine", "ours_syncfree", "ours_syncfree_folded", "ours_syncfree_unfolded", "ours_plan",
             "exllamav3_plan", "exl3_moe_alone", "bf16_grouped_mm")
    names = tuple(n for n in names if any(r["path"] == n for r in report["rows"]))
    print("\nms per layer call (events); engine / exllamav3_plan speed-up; max rel err engine | exllamav3_plan")
    print("routing tokens " + " ".join(f"{n[:15]:>15}" for n in names) + "  speedup  err")
    for (kind, tokens, name), r in sorted(by.items()):
        if name != "engine":
            continue
        cells = [f"{by[(kind, tokens, n)]['event_us'] / 1e3:15.2f}" if (kind, tokens, n) in by else f"{'-':>15}"
                 for n in names]
        base = by.get((kind, tokens, "exllamav3_plan"))
        speed = f"{base['event_us'] / r['event_us']:.2f}x" if base else "-"
        err = f"{r['rel_err_max']:.2e} | {base['rel_err_max']:.2e}" if base else "-"
        print(f"{kind:<7} {tokens:>6} " + " ".join(cells) + f"  {speed:>7}  {err}")


if __name__ == "__main__":
    sys.exit(main())
