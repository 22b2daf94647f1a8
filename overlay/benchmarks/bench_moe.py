"""Time the EXL3 CUDA MoE apply next to exllamav3's own MoE paths and a BF16 grouped-GEMM reference.

One GLM-5.3 Flash MoE layer as a TP=2 rank sees it (hidden 4096, 288 experts, top-8, intermediate
1024, K=4 mcg; random trellises, see glm53_overlay/exl3/gpu_checks.py). For each token count, every
path runs over 16 rotating routing/input sets (so consecutive calls touch different experts, not
L2-resident weights) and is timed with CUDA events: eager calls (median of many, host glue
included) and, where the path has no host sync, CUDA-graph replays of 16 calls (median / 16).

    PYTHONPATH=overlay/src python3 overlay/benchmarks/bench_moe.py --out overlay/benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from glm53_overlay.exl3 import gpu_checks, mcg4_moe, runtime

SHAPE = gpu_checks.GLM53_FLASH_RANK

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
# Our mcg4 kernels are also timed here above MCG4_MAX_TOKENS, where `apply` no longer uses them.
MCG4_SHOWN_UP_TO = 128
SETS = 16
EAGER_REPS = 100
GRAPH_REPS = 20
WARMUP = 10
SLOW_US = 10_000
SLOW_REPS = 16


class Bf16GroupedMoE:
    """Dequantized experts in bf16, run through torch._grouped_mm (graph-safe, no host sync)."""

    def __init__(self, dense: dict[str, torch.Tensor], act_limit: float) -> None:
        # [E, out, in] row-major, passed transposed: the layout grouped_mm wants for its B operand.
        self.w13 = torch.cat([dense["gate"], dense["up"]], dim=2).transpose(1, 2).contiguous().to(torch.bfloat16)
        self.w2 = dense["down"].transpose(1, 2).contiguous().to(torch.bfloat16)
        self.experts = self.w13.shape[0]
        self.inter = dense["gate"].shape[2]
        self.act_limit = act_limit

    def apply(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // top_k
        counts = torch.zeros(self.experts, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = x.to(torch.bfloat16).index_select(0, rows)
        gu = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs)
        g, u = gu[:, : self.inter].float(), gu[:, self.inter :].float()
        a = torch.nn.functional.silu(g)
        if self.act_limit:
            a = a.clamp(max=self.act_limit)
            u = u.clamp(-self.act_limit, self.act_limit)
        y = torch._grouped_mm((a * u).to(torch.bfloat16), self.w2.transpose(1, 2), offs=offs)
        out = torch.zeros((tokens, x.shape[1]), dtype=torch.float32, device=x.device)
        out.index_add_(0, rows, y.float() * w.reshape(-1)[order].float().unsqueeze(1))
        return out.to(x.dtype)


def per_expert_exl3(layer: runtime.Exl3CudaExperts, x, ids, w) -> torch.Tensor:
    """exllamav3's per-expert path: one exl3_gemm per projection per routed expert (host-synced counts)."""
    x16 = x.half()
    counts, token_sorted, weight_sorted = runtime.routing_tables(ids, w, layer.num_experts)
    out = torch.zeros((x.shape[0], layer.hidden), dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts.tolist()[: layer.num_experts]):
        if count:
            rows = token_sorted[start : start + count]
            y = layer.expert_forward(expert, x16.index_select(0, rows))
            out.index_add_(0, rows, y * weight_sorted[start : start + count].float().unsqueeze(1))
        start += count
    return out.to(x.dtype)


def coop_chunked(layer: runtime.Exl3CudaExperts, x, ids, w) -> torch.Tensor:
    """exllamav3's exl3_moe_coop on chunks of its 8-token limit (graph safe, no host sync)."""
    step = runtime.DECODE_MAX_TOKENS
    chunks = [layer.apply_decode(x[i : i + step].half(), ids[i : i + step], w[i : i + step]).to(x.dtype, copy=True)
              for i in range(0, x.shape[0], step)]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def time_eager(fn, sets) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*sets[0])
    end.record()
    end.synchronize()
    # Paths slower than SLOW_US per call get fewer calls, so the largest prefill sizes fit one device run.
    slow = start.elapsed_time(end) * 1e3 > SLOW_US
    for i in range(2 if slow else WARMUP):
        fn(*sets[i % len(sets)])
    times = []
    for i in range(SLOW_REPS if slow else EAGER_REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = sets[i % len(sets)]
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_graph(fn, sets, reps: int = GRAPH_REPS) -> float | None:
    try:
        for args in sets:
            fn(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for args in sets:
                fn(*args)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(sets))
        return statistics.median(times)
    except Exception as exc:  # a path that cannot be captured is reported, not fatal
        print(f"  graph capture failed: {type(exc).__name__}: {str(exc)[:200]}")
        torch.cuda.synchronize()
        return None


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def parse_args(default_tokens: tuple[int, ...], default_out: Path = Path("results")) -> argparse.Namespace:
    """--out (created) and --tokens, shared by the benchmarks here; bad counts exit before any GPU work."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(default_tokens), help="token counts to time")
    args = parser.parse_args()
    if any(t < 1 for t in args.tokens):
        parser.error(f"--tokens must be positive, got {args.tokens}")
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main() -> int:
    args = parse_args(TOKENS)
    layer = gpu_checks.make_layer(SHAPE)
    dense = gpu_checks.dense_weights(layer)
    bf16 = Bf16GroupedMoE(dense, SHAPE.act_limit)
    copy_bw = copy_bandwidth()
    expert_bytes_exl3 = sum(p.expert_bytes() for p in layer.projections().values())
    expert_bytes_bf16 = (bf16.w13[0].numel() + bf16.w2[0].numel()) * 2
    gen = torch.Generator().manual_seed(7)
    # Our kernels with programmatic dependent launch forced off: what PDL is worth where it is allowed (the
    # engine leaves it off on SM12x, see mcg4_moe.PDL_MAJORS).
    ours_no_pdl = (mcg4_moe.Mcg4Experts(layer.gate, layer.up, layer.down, act_limit=SHAPE.act_limit, pdl=False)
                   if layer.ours is not None else None)
    rows = []
    for tokens in args.tokens:
        sets = [gpu_checks.random_routing(SHAPE, tokens, gen, "cuda") for _ in range(SETS)]
        distinct = statistics.mean(int(torch.unique(ids).numel()) for _, ids, _ in sets)
        io_bytes = tokens * SHAPE.hidden * 2 * 2 + tokens * SHAPE.top_k * 12
        x0, ids0, w0 = sets[0]
        ref = gpu_checks.reference_moe(dense, x0.half(), ids0, w0, SHAPE.act_limit)
        paths = {
            "ours": (layer.apply, True, expert_bytes_exl3),
            "exl3_per_expert": (lambda x, i, w: per_expert_exl3(layer, x, i, w), False, expert_bytes_exl3),
            "exl3_moe_fused": (lambda x, i, w: layer.apply_fused(x.half(), i, w).to(x.dtype), tokens <= runtime.FUSED_ROWS, expert_bytes_exl3),
            "bf16_grouped_mm": (bf16.apply, True, expert_bytes_bf16),
        }
        if ours_no_pdl is not None and tokens <= runtime.MCG4_MAX_TOKENS:
            paths["ours_pdl_off"] = (ours_no_pdl.apply, True, expert_bytes_exl3)
        if layer.ours is not None and runtime.MCG4_MAX_TOKENS < tokens <= MCG4_SHOWN_UP_TO:
            paths["mcg4_unused"] = (layer.ours.apply, True, expert_bytes_exl3)
        if tokens <= runtime.COOP_CHUNKED_MAX_TOKENS:
            paths["exl3_moe_coop"] = (lambda x, i, w: coop_chunked(layer, x, i, w), True, expert_bytes_exl3)
        for name, (fn, graphable, per_expert) in paths.items():
            try:
                out0 = fn(x0, ids0, w0)
                err = gpu_checks.rel_err(out0, ref)
                max_abs = float((out0.float() - ref).abs().max())
                eager_us = time_eager(fn, sets)
                graph_us = time_graph(fn, sets) if graphable else None
            except Exception as exc:
                print(f"{name} T={tokens}: {type(exc).__name__}: {str(exc)[:300]}")
                rows.append({"path": name, "tokens": tokens, "error": f"{type(exc).__name__}: {exc}"[:500]})
                torch.cuda.synchronize()
                continue
            nbytes = distinct * per_expert + io_bytes
            best = min(t for t in (eager_us, graph_us) if t is not None)
            rows.append({
                "path": name, "tokens": tokens, "eager_us": eager_us, "graph_us": graph_us, "best_us": best,
                "bytes": nbytes, "distinct_experts": distinct,
                "implied_GBps": nbytes / (best * 1e-6) / 1e9, "frac_of_copy_bw": nbytes / (best * 1e-6) / copy_bw,
                "floor_us": nbytes / copy_bw * 1e6, "rel_err_vs_exact": err, "max_abs_err_vs_exact": max_abs,
                "ref_max_abs": float(ref.abs().max()),
            })
            if name == "ours":
                rows[-1]["kernels"] = layer.path_for(tokens)
            g = f"{graph_us:8.1f}" if graph_us is not None else "     n/a"
            print(f"T={tokens:<4} {name:<16} eager {eager_us:8.1f} us graph {g} us  {rows[-1]['implied_GBps']:7.0f} GB/s  "
                  f"err {err:.1e} (max abs {max_abs:.1e})")
    report = {
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "exllamav3": gpu_checks.exllamav3_version(),
        "shapes": {"hidden": SHAPE.hidden, "experts": SHAPE.experts, "top_k": SHAPE.top_k,
                   "intermediate_per_rank": SHAPE.intermediate, "bits": SHAPE.bits, "codebook": SHAPE.codebook,
                   "act_limit": SHAPE.act_limit},
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "method": f"CUDA events; eager median of {EAGER_REPS} calls after {WARMUP} warm-up ({SLOW_REPS} after 2 for "
                  f"paths slower than {SLOW_US} us per call); graph: median of "
                  f"{GRAPH_REPS} replays of {SETS} captured calls / {SETS}; {SETS} rotating routing sets; "
                  "bytes = distinct routed experts x packed (or bf16) expert bytes + bf16 x in/out + routing; "
                  "errors on the first routing set against an fp32 MoE over the reference decoder's exact weights",
        "rows": rows,
    }
    (args.out / "bench_moe.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "bench_moe.png")
    return 0


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    by_path: dict[str, list[tuple[int, float]]] = {}
    for r in report["rows"]:
        if "best_us" in r:
            by_path.setdefault(r["path"], []).append((r["tokens"], r["best_us"]))
    for name, pts in by_path.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    floor = [(r["tokens"], r["floor_us"]) for r in report["rows"] if r.get("path") == "ours" and "floor_us" in r]
    ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="EXL3 bytes / copy bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("µs per MoE layer (best of eager / graph)")
    ax.set_title(f"GLM-5.3 Flash MoE, one TP=2 rank, EXL3 4bpw mcg — {report['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
