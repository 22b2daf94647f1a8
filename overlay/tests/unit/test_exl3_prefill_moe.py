"""Our prefill MoE path (exl3/prefill_moe.py) on CPU: tiling, the engine's per-size choice, and the whole apply
against the exact reference with exllamav3's `reconstruct_had_batch` / `silu_mul` replaced by their CPU stand-ins
(tests/unit/exl3_cpu_kernels.py: the exact decoder, read through the same pointer tables).
"""

from __future__ import annotations

import exl3_cpu_kernels  # tests/unit: on sys.path through pytest's rootdir-based test module import
import pytest
import torch

from glm53_overlay.exl3 import gpu_checks, prefill_moe, runtime
from glm53_overlay.exl3.reference import dequantize

SHAPE = gpu_checks.MoeShape(hidden=256, experts=6, top_k=2, intermediate=128)


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


def test_engine_table_covers_the_measured_sizes():
    sizes = [count for count, _path in runtime.PREFILL_MEASURED]
    assert sizes == [128, 256, 512, 1024, 2048, 4096]
    assert {path for _count, path in runtime.PREFILL_MEASURED} <= {runtime.PATH_FUSED, runtime.PATH_PREFILL}


def _layer(monkeypatch, choice: str) -> runtime.Exl3CudaExperts:
    monkeypatch.setattr(runtime, "load_kernels", lambda: exl3_cpu_kernels.EXLLAMAV3)
    monkeypatch.setenv(runtime.PREFILL_KERNEL_ENV, choice)
    monkeypatch.setenv(runtime.DECODE_KERNEL_ENV, "exllamav3")
    return gpu_checks.make_layer(SHAPE, device="cpu")


@pytest.mark.parametrize("tokens", [1, 16, 130, 600, 5000])
def test_path_for_picks_ours_only_where_measured_faster(monkeypatch, tokens):
    layer = _layer(monkeypatch, "ours")
    assert layer.prefill is not None
    expected = tokens > runtime.COOP_CHUNKED_MAX_TOKENS and runtime.prefill_wins(tokens)
    assert (layer.path_for(tokens) == runtime.PATH_PREFILL) == expected


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
