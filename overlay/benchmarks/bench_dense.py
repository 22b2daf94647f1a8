"""Time one TP=2 rank's non-expert linears of GLM-5.3 Flash per decode step: BF16 against FP8.

What `glm53_dense_quantization` changes. Shapes come from the real config (/work/shared/REFERENCE.md and
transformers' glm5_next): 34 KDA layers, 11 MLA/DSA layers (with the DSA indexer), 42 shared experts,
the dense MLP of layers 0-2, the routers and lm_head, sharded as vLLM shards them at TP=2 (column-parallel
outputs and row-parallel inputs halved, low-rank and indexer projections replicated; see `linears()`).
Every layer gets its own weight tensors, so a step reads every byte from HBM as decode does.

Variants per step (one CUDA graph holding every linear of the step, replayed; median of the replays):
- bf16: torch.matmul on every linear.
- fp8_row / fp8_tensor: the linears the setting converts run as dynamic activation quantization (per token /
  per tensor, included in the timing) + torch._scaled_mm on an FP8 weight with per-row / per-tensor scales;
  the linears that stay BF16 in the engine (`fp8=False` below) still run in BF16.
Per-group graphs are timed too, and lm_head once more in FP8 as a what-if (vLLM's ParallelLMHead is not a
LinearBase, so the setting does not convert it).

    python3 overlay/benchmarks/bench_dense.py --out overlay/benchmarks/results/dense
"""

from __future__ import annotations

import json
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from bench_moe import copy_bandwidth, parse_args

TOKENS = (1, 2, 4, 8)
GRAPH_REPS = 30
FP8_MAX = 448.0
GB10_GBPS = 273.0


@dataclass(frozen=True)
class Linear:
    group: str
    name: str
    out: int  # per rank
    inp: int  # per rank
    count: int  # layers holding one
    sharding: str
    fp8: bool  # converted by glm53_dense_quantization=fp8


def linears() -> list[Linear]:
    """One TP=2 rank of GLM-5.3 Flash (hidden 4096), [out, in] per rank, as vLLM builds the layers."""
    kda, dsa, moe, dense = 34, 11, 42, 3
    return [
        # KDA linear attention: 64 heads x 128 = 8192 wide; q/k/v merged column-parallel.
        Linear("kda", "qkv_proj", 3 * 8192 // 2, 4096, kda, "column (3 x 8192 / 2)", True),
        Linear("kda", "b_proj", 64 // 2, 4096, kda, "column (64 heads / 2)", True),
        Linear("kda", "f_a_proj", 128, 4096, kda, "replicated (low rank 128)", True),
        Linear("kda", "g_a_proj", 128, 4096, kda, "replicated (low rank 128)", True),
        Linear("kda", "f_b_proj", 8192 // 2, 128, kda, "column", True),
        Linear("kda", "g_b_proj", 8192 // 2, 128, kda, "column", True),
        Linear("kda", "o_proj", 4096, 8192 // 2, kda, "row ([4096, 8192] / 2)", True),
        # MLA/DSA (NoPE): q_lora 1536, kv_lora 512, 64 heads x (256 nope + 256 v).
        Linear("dsa", "fused_qkv_a_proj", 1536 + 512, 4096, dsa, "replicated (q_a 1536 + kv_a 512)", True),
        Linear("dsa", "q_b_proj", 64 * 256 // 2, 1536, dsa, "column", True),
        # Decode absorbs kv_b into W_UK / W_UV, which vLLM's MLA keeps BF16 whatever kv_b's method.
        Linear("dsa", "kv_b_proj (absorbed W_UK/W_UV)", 64 * 512 // 2, 512, dsa, "column", False),
        Linear("dsa", "o_proj", 4096, 16384 // 2, dsa, "row ([4096, 16384] / 2)", True),
        Linear("dsa", "indexer.wq_b", 32 * 128, 1536, dsa, "replicated (vLLM Indexer)", True),
        # Built with quant_config=None by vLLM: always BF16.
        Linear("dsa", "indexer.wk_weights_proj", 128 + 32, 4096, dsa, "replicated, quant_config=None", False),
        Linear("shared_expert", "gate_up_proj", 2 * 2048 // 2, 4096, moe, "column (2 x 2048 / 2)", True),
        Linear("shared_expert", "down_proj", 4096, 2048 // 2, moe, "row", True),
        Linear("router", "gate", 288, 4096, moe, "replicated; stays BF16 (routing precision)", False),
        Linear("dense_mlp", "gate_up_proj", 2 * 12288 // 2, 4096, dense, "column (2 x 12288 / 2)", True),
        Linear("dense_mlp", "down_proj", 4096, 12288 // 2, dense, "row", True),
        Linear("lm_head", "lm_head", 154880 // 2, 4096, 1, "vocab-parallel (154,880 / 2)", False),
    ]


class Weights:
    """Every layer's own BF16 weight and, for converted linears, its FP8 copies (per-row and per-tensor scales)."""

    def __init__(self, specs: list[Linear], gen: torch.Generator) -> None:
        self.bf16: dict[Linear, list[torch.Tensor]] = {}
        self.fp8_row: dict[Linear, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.fp8_tensor: dict[Linear, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for spec in specs:
            ws = [(torch.randn(spec.out, spec.inp, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
                  for _unused in range(spec.count)]
            self.bf16[spec] = ws
            if spec.fp8 or spec.group == "lm_head":
                self.fp8_row[spec] = [quantize_rows(w) for w in ws]
                self.fp8_tensor[spec] = [quantize_tensor(w) for w in ws]


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.t().contiguous()


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax() / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def fp8_row_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    # Dynamic per-token activation scales, as vLLM's online FP8 uses with cutlass.
    a_scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    xq = (x.float() / a_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, wq.t(), scale_a=a_scale, scale_b=w_scale, out_dtype=torch.bfloat16)


def fp8_tensor_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    a_scale = (x.float().abs().amax() / FP8_MAX).clamp(min=1e-12)
    xq = (x.float() / a_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, wq.t(), scale_a=a_scale, scale_b=w_scale, out_dtype=torch.bfloat16)


def step_fn(specs: list[Linear], weights: Weights, variant: str, tokens: int, fp8_lm_head: bool = False):
    inputs = {spec.inp: torch.randn(tokens, spec.inp, device="cuda").to(torch.bfloat16) for spec in specs}
    # *_gemm variants: activations quantized once per input width outside the graph, so the timing is the
    # FP8 GEMMs alone (vLLM quantizes each linear's input in one fused kernel; our torch ops take ~6).
    rowwise = variant.startswith("fp8_row")
    pre = {inp: quantize_activation(x, rowwise) for inp, x in inputs.items()}

    def run() -> None:
        for spec in specs:
            x = inputs[spec.inp]
            use_fp8 = variant != "bf16" and (spec.fp8 or (fp8_lm_head and spec.group == "lm_head"))
            if not use_fp8:
                for w in weights.bf16[spec]:
                    torch.matmul(x, w.t())
                continue
            table, fn = ((weights.fp8_row, fp8_row_linear) if rowwise else (weights.fp8_tensor, fp8_tensor_linear))
            for wq, scale in table[spec]:
                if variant.endswith("_gemm"):
                    xq, a_scale = pre[spec.inp]
                    torch._scaled_mm(xq, wq.t(), scale_a=a_scale, scale_b=scale, out_dtype=torch.bfloat16)
                else:
                    fn(x, wq, scale)
    return run


def quantize_activation(x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.float().abs().amax(dim=1, keepdim=True) if rowwise else x.float().abs().amax()
    a_scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (x.float() / a_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), a_scale


def time_graph(run) -> float:
    """Median microseconds of one replay of a graph holding `run`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _unused in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _unused in range(GRAPH_REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)


def weight_bytes(specs: list[Linear], variant: str, fp8_lm_head: bool = False) -> int:
    total = 0
    for spec in specs:
        params = spec.out * spec.inp * spec.count
        use_fp8 = variant != "bf16" and (spec.fp8 or (fp8_lm_head and spec.group == "lm_head"))
        total += params * (1 if use_fp8 else 2)
        if use_fp8:
            total += 4 * spec.count * (spec.out if variant.startswith("fp8_row") else 1)
    return total


def check_accuracy(weights: Weights, spec: Linear) -> dict[str, float]:
    """Relative error of both FP8 variants against BF16 on one layer of `spec`, 8 random tokens."""
    x = torch.randn(8, spec.inp, device="cuda").to(torch.bfloat16)
    ref = (x.float() @ weights.bf16[spec][0].float().t())
    out = {}
    for name, table, fn in (("fp8_row", weights.fp8_row, fp8_row_linear),
                            ("fp8_tensor", weights.fp8_tensor, fp8_tensor_linear)):
        got = fn(x, *table[spec][0]).float()
        out[name] = float((got - ref).norm() / ref.norm())
    return out


def main() -> int:
    args = parse_args(TOKENS, Path("results/dense"))
    specs = linears()
    weights = Weights(specs, torch.Generator(device="cuda").manual_seed(7))
    copy_bw = copy_bandwidth()
    groups = sorted({s.group for s in specs}, key=[s.group for s in specs].index)
    variants = ("bf16", "fp8_row", "fp8_tensor", "fp8_row_gemm", "fp8_tensor_gemm")
    rows = []
    for tokens in args.tokens:
        for variant in variants:
            us = time_graph(step_fn(specs, weights, variant, tokens))
            nbytes = weight_bytes(specs, variant)
            rows.append({"scope": "step", "variant": variant, "tokens": tokens, "graph_us": us, "weight_bytes": nbytes,
                         "implied_GBps": nbytes / (us * 1e-6) / 1e9, "floor_us": nbytes / copy_bw * 1e6})
            print(f"T={tokens} step {variant:<10} {us:9.1f} us  {nbytes / 1e9:6.3f} GB  "
                  f"{rows[-1]['implied_GBps']:6.0f} GB/s", flush=True)
            for group in groups:
                members = [s for s in specs if s.group == group]
                for fp8_lm in ((False, True) if group == "lm_head" and variant != "bf16" else (False,)):
                    gus = time_graph(step_fn(members, weights, variant, tokens, fp8_lm))
                    gbytes = weight_bytes(members, variant, fp8_lm)
                    rows.append({"scope": group + (" (fp8 what-if)" if fp8_lm else ""), "variant": variant,
                                 "tokens": tokens, "graph_us": gus, "weight_bytes": gbytes,
                                 "implied_GBps": gbytes / (gus * 1e-6) / 1e9})
                    print(f"T={tokens}   {rows[-1]['scope']:<24} {variant:<10} {gus:9.1f} us  {gbytes / 1e9:6.3f} GB",
                          flush=True)
    summary = []
    for tokens in args.tokens:
        step = {r["variant"]: r for r in rows if r["scope"] == "step" and r["tokens"] == tokens}
        summary.append({"tokens": tokens, **{f"{v}_us": step[v]["graph_us"] for v in variants},
                        **{f"speedup_{v}": step["bf16"]["graph_us"] / step[v]["graph_us"] for v in variants[1:]}})
    bytes_bf16, bytes_fp8 = weight_bytes(specs, "bf16"), weight_bytes(specs, "fp8_row")
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "copy_bandwidth_GBps": copy_bw / 1e9,
        "model": "GLM-5.3 Flash, one TP=2 rank, decode step without MTP/draft layers",
        "linears_per_step": sum(s.count for s in specs),
        "fp8_linears_per_step": sum(s.count for s in specs if s.fp8),
        "linears": [{"group": s.group, "name": s.name, "out_per_rank": s.out, "in_per_rank": s.inp, "layers": s.count,
                     "sharding": s.sharding, "fp8_with_setting": s.fp8,
                     "bf16_bytes": s.out * s.inp * s.count * 2} for s in specs],
        "method": f"one CUDA graph per (scope, variant, tokens) holding every linear of the scope, each layer its own "
                  f"weights; median of {GRAPH_REPS} replays (CUDA events). FP8 timings include the dynamic "
                  "activation quantization (amax, scale, cast) of every linear. Random N(0, 0.02) weights.",
        "accuracy_rel_err": {s.group + "." + s.name: check_accuracy(weights, s)
                             for s in specs if s.fp8 and s.count and s.name in ("qkv_proj", "o_proj", "down_proj")},
        "gb10_estimate": {
            "bandwidth_GBps": GB10_GBPS, "bf16_bytes": bytes_bf16, "fp8_bytes": bytes_fp8,
            "bf16_ms_at_bandwidth": bytes_bf16 / GB10_GBPS / 1e6, "fp8_ms_at_bandwidth": bytes_fp8 / GB10_GBPS / 1e6,
        },
        "summary": summary,
        "rows": rows,
    }
    (args.out / "bench_dense.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
