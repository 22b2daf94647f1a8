"""Block shapes, tile size and decode/GEMM overlap of our sync-free prefill path (prefill_moe + prefill_gemm), unfolded
formulation, timed as CUDA-graph replays (GPU-busy time) at a few sizes, random routing; plus the split into decode,
input rotation and GEMMs, the folded path it replaces, and cuBLAS over the same tiles. Checks each variant against
the fp32 reference. Writes tune_prefill.json.

    PYTHONPATH=overlay/src python3 overlay/benchmarks/tune_prefill.py --out overlay/benchmarks/results/prefill
"""

from __future__ import annotations

import json
import sys

import torch
from bench_moe import SHAPE, parse_args, time_graph
from bench_prefill import routing_set

from glm53_overlay.exl3 import gpu_checks, prefill_gemm, prefill_moe

TOKENS = (512, 4096, 8192)
# Unfolded kernels (prefill_gemm.ROT_*_BLOCK): (rows, k) per block, warps, stages; columns are one Hadamard block.
# The best three of each from dev/tune_prefill_run5.json; 4 warps spill gate_up's two 128-column accumulators (2x
# slower in dev/tune_prefill_run4.json).
ROT_GATE_UP = ((128, 64, 8, 3), (64, 64, 8, 3), (128, 32, 8, 4))
ROT_DOWN = ((64, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 4))
# prefill_gemm.ROW_PROGRAMS (0: one row program per possible row block).
ROW_PROGRAMS = (0, 2, 4, 8)
# Tile 32 measured 1-2% faster than 16 at twice the scratch (1.6 GB; dev/tune_prefill_run4.json): 16 kept.
TILES = (16,)


def graph_us(fn, sets) -> float:
    """bench_moe's graph timing, 3 replays; a capture that fails raises, so the variant is skipped."""
    us = time_graph(fn, sets, reps=3)
    if us is None:
        raise RuntimeError("graph capture failed")
    return us


def bmm_baseline(pre, token_counts, rows) -> None:
    """cuBLAS (torch.bmm) over the same decoded tiles, rows padded to T*k/E per expert: the read rate a library
    GEMM gets from this scratch (gate, up, down per tile, every tile)."""
    sc = pre.scratch(0)
    for tokens in token_counts:
        m = max(16, (tokens * SHAPE.top_k // SHAPE.experts + 15) // 16 * 16)
        xs = torch.randn((pre.tile, m, pre.hidden), device="cuda").half()
        acts = torch.randn((pre.tile, m, pre.intermediate), device="cuda").half()
        tiles = SHAPE.experts // pre.tile

        def run():
            for _ in range(tiles):
                torch.bmm(xs, sc["gate"])
                torch.bmm(xs, sc["up"])
                torch.bmm(acts, sc["down"])
        us = graph_us(lambda: run(), [()])
        rows.append({"variant": "cublas bmm, padded rows", "tokens": tokens, "graph_us": us, "rows_per_expert": m})
        print(f"{'cublas bmm t16 rows ' + str(m):<40} T={tokens:<5} {us:8.0f} us", flush=True)


def best_settings(report: dict) -> dict:
    """The fastest measured settings of the unfolded path (sums over the token counts): each kernel's block and the
    row-program cap from their GEMM-only rows, overlap from the full rows."""
    rows = [r for r in report["rows"] if "graph_us" in r and "rot_gate_up_block" in r]

    def best(prefix: str, key: str, unmeasured):
        totals: dict = {}
        for r in rows:
            if r["variant"].startswith(prefix):
                value = tuple(r[key]) if isinstance(r[key], list | tuple) else r[key]
                totals[value] = totals.get(value, 0.0) + r["graph_us"]
        return min(totals, key=totals.get) if totals else unmeasured

    full: dict[tuple, float] = {}
    for r in rows:
        if r["variant"].startswith("unfolded full "):
            full[(r["tile"], r["overlap"])] = full.get((r["tile"], r["overlap"]), 0.0) + r["graph_us"]
    tile, overlap = min(full, key=full.get) if full else (TILES[0], True)
    return {"rot_gate_up_block": list(best("unfolded gemm only t16 gate_up", "rot_gate_up_block",
                                           prefill_gemm.ROT_GATE_UP_BLOCK)),
            "rot_down_block": list(best("unfolded gemm only t16 down", "rot_down_block", prefill_gemm.ROT_DOWN_BLOCK)),
            "row_programs": best("unfolded gemm only t16 row_programs", "row_programs", prefill_gemm.ROW_PROGRAMS),
            "tile": tile, "overlap": overlap}


def apply_settings(settings: dict) -> None:
    prefill_gemm.ROT_GATE_UP_BLOCK = tuple(settings["rot_gate_up_block"])
    prefill_gemm.ROT_DOWN_BLOCK = tuple(settings["rot_down_block"])
    prefill_gemm.ROW_PROGRAMS = settings["row_programs"]


def main() -> int:
    args = parse_args(TOKENS)
    layer = gpu_checks.make_layer(SHAPE)
    dense = gpu_checks.dense_weights(layer)
    gen = torch.Generator().manual_seed(5)
    data = {t: [routing_set(t, "random", gen) for _ in range(2)] for t in args.tokens}
    refs = {t: gpu_checks.reference_moe(dense, *(lambda x, i, w: (x.half(), i, w))(*data[t][0]), SHAPE.act_limit)
            for t in args.tokens}
    del dense
    rows = []

    def measure(label, pre, **extra):
        for tokens in args.tokens:
            fn = lambda x, i, w: pre.apply(x.half(), i, w)  # noqa: E731
            try:
                err = gpu_checks.rel_err(fn(*data[tokens][0]), refs[tokens])
                us = graph_us(fn, data[tokens])
            except Exception as exc:
                print(f"{label} T={tokens}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                torch.cuda.synchronize()
                continue
            rows.append({"variant": label, "tokens": tokens, "graph_us": us, "rel_err": err,
                         "rot_gate_up_block": prefill_gemm.ROT_GATE_UP_BLOCK,
                         "rot_down_block": prefill_gemm.ROT_DOWN_BLOCK, "row_programs": prefill_gemm.ROW_PROGRAMS,
                         "tile": pre.tile, "overlap": pre.overlap,
                         "unfolded": pre.unfolded, **extra})
            print(f"{label:<48} T={tokens:<5} {us:8.0f} us  err {err:.2e}", flush=True)

    def layer_of(tile, overlap=True, unfolded=True):
        return prefill_moe.PrefillExperts(layer.gate, layer.up, layer.down, codebook=SHAPE.codebook, ext=layer.ext,
                                          act_limit=SHAPE.act_limit, tile_experts=tile, overlap=overlap,
                                          unfolded=unfolded)

    folded = layer_of(16, overlap=True, unfolded=False)
    measure("folded full t16 overlap=True (the path before)", folded)
    folded.tile_mlp = lambda *a, **k: None
    measure("folded decode only t16", folded)
    del folded
    pre16 = layer_of(16, overlap=False)
    bmm_baseline(pre16, args.tokens, rows)
    real_mlp = pre16.tile_mlp_rotated
    pre16.tile_mlp_rotated = lambda *a, **k: None
    measure("unfolded decode + rotate only t16", pre16)
    pre16.tile_mlp_rotated = real_mlp
    # GEMM-only rows run over real decoded weights (the first tile's), with the decode itself skipped.
    pre16._decode_tile(0, pre16.tile, None, 0)
    real_decode = pre16._decode_tile
    pre16._decode_tile = lambda lo, hi, ids, buffer: tuple(
        pre16.scratch(0)[n][: hi - lo] for n in ("gate", "up", "down"))
    real_rotate = pre16.rotate_inputs
    pre16.rotate_inputs = lambda *a, **k: None
    measure("unfolded gemm only t16 (no rotate, no decode)", pre16)
    pre16.rotate_inputs = real_rotate
    base_gu, base_down = prefill_gemm.ROT_GATE_UP_BLOCK, prefill_gemm.ROT_DOWN_BLOCK
    for gu in ROT_GATE_UP:
        prefill_gemm.ROT_GATE_UP_BLOCK = gu
        measure(f"unfolded gemm only t16 gate_up {gu}", pre16)
    prefill_gemm.ROT_GATE_UP_BLOCK = base_gu
    for dn in ROT_DOWN:
        prefill_gemm.ROT_DOWN_BLOCK = dn
        measure(f"unfolded gemm only t16 down {dn}", pre16)
    prefill_gemm.ROT_DOWN_BLOCK = base_down
    # The cap with the best blocks (its rows carry the blocks they ran with).
    apply_settings(best_settings({"rows": rows}))
    for cap in ROW_PROGRAMS:
        prefill_gemm.ROW_PROGRAMS = cap
        measure(f"unfolded gemm only t16 row_programs {cap}", pre16)
    pre16._decode_tile = real_decode
    del pre16
    # The full runs below use the fastest GEMM settings found above.
    apply_settings(best_settings({"rows": rows}))
    for tile in TILES:
        for overlap in (False, True):
            pre = layer_of(tile, overlap)
            measure(f"unfolded full t{tile} overlap={overlap}", pre)
            del pre
            torch.cuda.empty_cache()
    # The row-program cap on skewed routing too (a hot expert's row blocks queue on fewer programs).
    skewed = {t: [routing_set(t, "skewed", gen) for _ in range(2)] for t in args.tokens}
    pre = layer_of(TILES[0])
    best_cap = prefill_gemm.ROW_PROGRAMS
    for cap in (0, best_cap):
        prefill_gemm.ROW_PROGRAMS = cap
        for tokens in args.tokens:
            us = graph_us(lambda x, i, w: pre.apply(x.half(), i, w), skewed[tokens])
            rows.append({"variant": f"skewed full t{pre.tile} row_programs {cap}", "tokens": tokens, "graph_us": us})
            print(f"{'skewed full row_programs ' + str(cap):<48} T={tokens:<5} {us:8.0f} us", flush=True)
    prefill_gemm.ROW_PROGRAMS = best_cap
    report = {"device": torch.cuda.get_device_name(), "rows": rows}
    report["best"] = best_settings(report)
    print("best:", report["best"])
    (args.out / "tune_prefill.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
