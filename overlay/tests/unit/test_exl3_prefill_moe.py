"""Our prefill MoE path (exl3/prefill_moe.py) on CPU: tiling, the engine's per-size choice, and the whole apply
against the exact reference with exllamav3's `reconstruct_had_batch` / `silu_mul` replaced by their CPU stand-ins
(tests/unit/exl3_cpu_kernels.py: the exact decoder, read through the same pointer tables).
"""

from __future__ import annotations

import json
from pathlib import Path

import exl3_cpu_kernels  # tests/unit: on sys.path through pytest's rootdir-based test module import
import pytest
import torch

from glm53_overlay.exl3 import gpu_checks, prefill_moe, runtime
from glm53_overlay.exl3.reference import dequantize

SHAPE = gpu_checks.MoeShape(hidden=256, experts=6, top_k=2, intermediate=128)
# The committed H200 prefill benchmark that runtime.PREFILL_MEASURED is taken from (results/prefill/COMMAND.md).
PREFILL_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "prefill" / "bench_moe.json"


def _committed_winners() -> dict[int, str]:
    """Per token count of the committed results, the faster of exllamav3's exl3_moe (row `exl3_moe_fused`) and our
    prefill path at the engine's default tile (row `ours_prefill_t16`), by eager median (our path runs eager only).
    Read from the JSON here, not from runtime, so a table that disagrees with the measurement fails."""
    rows = json.loads(PREFILL_RESULTS.read_text())["rows"]
    eager_us = {(row["path"], row["tokens"]): row["eager_us"] for row in rows}
    ours = "ours_prefill_t%d" % prefill_moe.DEFAULT_TILE_EXPERTS
    sizes = sorted({tokens for path, tokens in eager_us if path == ours})
    assert sizes, "no %s rows in %s" % (ours, PREFILL_RESULTS)
    return {tokens: runtime.PATH_PREFILL if eager_us[(ours, tokens)] < eager_us[("exl3_moe_fused", tokens)]
            else runtime.PATH_FUSED for tokens in sizes}


def _committed_threshold(winners: dict[int, str]) -> int | None:
    """The smallest measured count from which our path won at every larger measured count (None: it never did)."""
    threshold = None
    for tokens in sorted(winners, reverse=True):
        if winners[tokens] != runtime.PATH_PREFILL:
            break
        threshold = tokens
    return threshold


def test_tiles_group_touched_experts_with_contiguous_rows():
    counts = [3, 0, 2, 5, 0, 1, 4]
    # rows sorted by expert: e0 0-2, e2 3-4, e3 5-9, e5 10, e6 11-14
    assert prefill_moe.tiles(counts, 2) == [([0, 2], 0, 5), ([3, 5], 5, 6), ([6], 11, 4)]
    assert prefill_moe.tiles([0, 0], 4) == []


def test_scratch_bytes_of_the_glm53_rank_shape():
    # 16 experts x gate/up/down x 4096 x 1024 fp16
    assert prefill_moe.scratch_bytes(4096, 1024, 16) == 402_653_184


@pytest.mark.parametrize("raw", ["0", "-3", "many"])
def test_tile_setting_refuses_bad_values(monkeypatch, raw):
    monkeypatch.setenv(prefill_moe.TILE_ENV, raw)
    with pytest.raises(ValueError, match=prefill_moe.TILE_ENV):
        prefill_moe.tile_experts_setting()


def test_prefill_wins_uses_the_largest_measured_count_at_or_below():
    measured = ((128, runtime.PATH_FUSED), (512, runtime.PATH_PREFILL), (2048, runtime.PATH_FUSED))
    assert not runtime.prefill_wins(100, measured)
    assert not runtime.prefill_wins(511, measured)
    assert runtime.prefill_wins(512, measured)
    assert runtime.prefill_wins(2047, measured)
    assert not runtime.prefill_wins(9000, measured)


def test_engine_table_is_the_committed_measurement():
    # Every measured size with the winner the committed results show, and nothing else.
    assert dict(runtime.PREFILL_MEASURED) == _committed_winners()
    assert len(dict(runtime.PREFILL_MEASURED)) == len(runtime.PREFILL_MEASURED)


def _layer(monkeypatch, choice: str) -> runtime.Exl3CudaExperts:
    monkeypatch.setattr(runtime, "load_kernels", lambda: exl3_cpu_kernels.EXLLAMAV3)
    monkeypatch.setenv(runtime.PREFILL_KERNEL_ENV, choice)
    monkeypatch.setenv(runtime.DECODE_KERNEL_ENV, "exllamav3")
    return gpu_checks.make_layer(SHAPE, device="cpu")


def _probe_sizes() -> list[int]:
    sizes = sorted(_committed_winners())
    return sorted({1, runtime.COOP_CHUNKED_MAX_TOKENS, runtime.COOP_CHUNKED_MAX_TOKENS + 1, 2 * sizes[-1]}
                  | {tokens + step for tokens in sizes for step in (-1, 0, 1)})


def test_path_for_picks_ours_only_where_the_committed_results_say_it_won(monkeypatch):
    # Expected path from the JSON alone: the winner at the largest measured count <= tokens, exl3_moe below the
    # smallest; the coop kernels up to COOP_CHUNKED_MAX_TOKENS (our decode kernels are off in _layer).
    winners = _committed_winners()
    layer = _layer(monkeypatch, "ours")
    assert layer.prefill is not None
    for tokens in _probe_sizes():
        measured_at_or_below = [count for count in winners if count <= tokens]
        if tokens <= runtime.COOP_CHUNKED_MAX_TOKENS:
            expected = runtime.PATH_COOP
        elif measured_at_or_below:
            expected = winners[max(measured_at_or_below)]
        else:
            expected = runtime.PATH_FUSED
        assert layer.path_for(tokens) == expected, tokens


def test_prefill_switch_sits_where_the_committed_results_cross(monkeypatch):
    # The committed H200 results: exl3_moe wins up to 2048 tokens, ours from 4096 (docs: "from 4096 tokens only").
    threshold = _committed_threshold(_committed_winners())
    assert threshold == 4096
    layer = _layer(monkeypatch, "ours")
    assert layer.path_for(threshold) == runtime.PATH_PREFILL
    assert layer.path_for(threshold - 1) == runtime.PATH_FUSED


def test_exllamav3_switch_turns_our_prefill_off(monkeypatch):
    layer = _layer(monkeypatch, "exllamav3")
    assert layer.prefill is None
    assert all(layer.path_for(count) != runtime.PATH_PREFILL for count, _path in runtime.PREFILL_MEASURED)


def test_bad_prefill_switch_is_refused(monkeypatch):
    monkeypatch.setenv(runtime.PREFILL_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=runtime.PREFILL_KERNEL_ENV):
        runtime.prefill_kernel_choice()


@pytest.mark.parametrize("tile", [1, 4, 16])
def test_apply_matches_the_exact_reference(monkeypatch, tile):
    layer = _layer(monkeypatch, "ours")
    pre = prefill_moe.PrefillExperts(layer.gate, layer.up, layer.down, codebook=SHAPE.codebook,
                                     ext=exl3_cpu_kernels.EXLLAMAV3, act_limit=SHAPE.act_limit, tile_experts=tile)
    dense = {name: torch.stack([dequantize(p.trellis[e], p.suh[e], p.svh[e], codebook="mcg") for e in range(SHAPE.experts)])
             for name, p in layer.projections().items()}
    gen = torch.Generator().manual_seed(3)
    x, ids, w = gpu_checks.random_routing(SHAPE, 40, gen, "cpu")
    ids[0, 0] = -1  # an expert of another rank: contributes nothing here
    out = pre.apply(x.half(), ids, w)
    keep = ids >= 0
    ref = gpu_checks.reference_moe(dense, x.half(), torch.where(keep, ids, 0), torch.where(keep, w, 0.0), SHAPE.act_limit)
    assert out.dtype == torch.float32 and out.shape == (40, SHAPE.hidden)
    assert gpu_checks.rel_err(out, ref) <= 3e-3
