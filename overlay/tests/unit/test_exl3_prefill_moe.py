"""Our prefill MoE path (exl3/prefill_moe.py) on CPU: the device-side routing, the engine's per-size choice (read back
from the committed H200 results), and the whole apply, in both formulations, against the exact reference with
exllamav3's `reconstruct_had_batch` / `reconstruct_batch` replaced by their CPU stand-ins (tests/unit/exl3_cpu_kernels.py:
the exact decoder, read through the same pointer tables) and our Triton kernels by their torch twins (`prefill_gemm.*_reference`).
"""

from __future__ import annotations

import json
from pathlib import Path

import exl3_cpu_kernels  # tests/unit: on sys.path through pytest's rootdir-based test module import
import pytest
import torch

from glm53_overlay.exl3 import gpu_checks, prefill_gemm, prefill_moe, runtime
from glm53_overlay.exl3.hadamard import HADAMARD_BLOCK, hadamard_128
from glm53_overlay.exl3.reference import dequantize

SHAPE = gpu_checks.MoeShape(hidden=256, experts=6, top_k=2, intermediate=128)
# The committed H200 prefill benchmark that runtime.PREFILL_MEASURED is taken from (results/prefill/COMMAND.md).
PREFILL_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "prefill" / "bench_prefill.json"
# The rows of the two paths the engine chooses between (bench_prefill.py).
ROW_OF_PATH = {runtime.PATH_PREFILL: "ours_syncfree", runtime.PATH_FUSED: "ours_plan"}




def _committed_winners() -> dict[int, str]:
    """Per token count of the committed results (random routing: the engine cannot know the routing ahead), the
    faster of our sync-free path and exllamav3's plan with our GEMMs, by event time. Read from the JSON here, not
    from runtime, so a table that disagrees with the measurement fails."""
    rows = [row for row in json.loads(PREFILL_RESULTS.read_text())["rows"] if row["routing"] == "random"]
    event_us = {(row["path"], row["tokens"]): row["event_us"] for row in rows if "event_us" in row}
    sizes = sorted({tokens for _path, tokens in event_us})
    assert sizes, "no timed rows in %s" % PREFILL_RESULTS
    return {tokens: min(ROW_OF_PATH, key=lambda path: event_us[(ROW_OF_PATH[path], tokens)]) for tokens in sizes}


def test_engine_table_is_the_committed_measurement():
    # Every measured size with the winner the committed results show, and nothing else.
    assert dict(runtime.PREFILL_MEASURED) == _committed_winners()
    assert len(dict(runtime.PREFILL_MEASURED)) == len(runtime.PREFILL_MEASURED)


def test_a_table_that_disagrees_with_the_results_is_caught():
    # The check above is not vacuous: flip any one measured size and it no longer matches.
    for index, (tokens, path) in enumerate(runtime.PREFILL_MEASURED):
        other = runtime.PATH_FUSED if path == runtime.PATH_PREFILL else runtime.PATH_PREFILL
        flipped = list(runtime.PREFILL_MEASURED)
        flipped[index] = (tokens, other)
        assert dict(flipped) != _committed_winners()


def test_table_per_gpu():
    assert runtime.prefill_measured((9, 0)) == runtime.PREFILL_MEASURED
    assert runtime.prefill_measured(None) == runtime.PREFILL_MEASURED  # the CPU stand-ins
    # GB10: the bytes-moved estimate keeps exllamav3's plan at every size; unmeasured GPUs likewise.
    assert not any(runtime.prefill_wins(t, runtime.prefill_measured((12, 1))) for t in (512, 4096, 65536))
    assert not runtime.prefill_wins(8192, runtime.prefill_measured((8, 0)))


def test_routing_sorts_by_expert_on_the_device_side():
    ids = torch.tensor([[2, 0], [9, 2], [1, 2]])  # 9: an expert of another rank
    w = torch.tensor([[0.5, 0.25], [1.0, 0.75], [0.125, 0.0625]])
    counts, starts, tok, wt = prefill_moe.routing(ids, w, 3)
    assert counts.tolist() == [1, 1, 3, 1] and starts.tolist() == [0, 1, 2, 5]
    assert tok.tolist() == [0, 2, 0, 1, 2, 1]
    assert wt.tolist() == [0.25, 0.125, 0.5, 0.75, 0.0625, 1.0]


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
    # Expected path from the JSON alone: the winner at the largest measured count <= tokens, exllamav3's plan below
    # the smallest; the coop kernels up to COOP_CHUNKED_MAX_TOKENS (our decode kernels are off in _layer).
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


def test_exllamav3_switch_turns_our_prefill_off(monkeypatch):
    layer = _layer(monkeypatch, "exllamav3")
    assert layer.prefill is None
    assert all(layer.path_for(count) != runtime.PATH_PREFILL for count, _path in runtime.PREFILL_MEASURED)


def test_bad_prefill_switch_is_refused(monkeypatch):
    monkeypatch.setenv(runtime.PREFILL_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=runtime.PREFILL_KERNEL_ENV):
        runtime.prefill_kernel_choice()


def _dense(layer: runtime.Exl3CudaExperts) -> dict[str, torch.Tensor]:
    return {name: torch.stack([dequantize(p.trellis[e], p.suh[e], p.svh[e], codebook="mcg") for e in range(SHAPE.experts)])
            for name, p in layer.projections().items()}


@pytest.mark.parametrize("unfolded", [True, False])
@pytest.mark.parametrize("tile", [1, 4, 16])
def test_apply_matches_the_exact_reference(monkeypatch, tile, unfolded):
    layer = _layer(monkeypatch, "ours")
    pre = prefill_moe.PrefillExperts(layer.gate, layer.up, layer.down, codebook=SHAPE.codebook, ext=exl3_cpu_kernels.EXLLAMAV3,
                                     act_limit=SHAPE.act_limit, tile_experts=tile, unfolded=unfolded)
    gen = torch.Generator().manual_seed(3)
    x, ids, w = gpu_checks.random_routing(SHAPE, 40, gen, "cpu")
    ids[0, 0] = -1  # an expert of another rank: contributes nothing here
    out = pre.apply(x.half(), ids, w)
    keep = ids >= 0
    ref = gpu_checks.reference_moe(_dense(layer), x.half(), torch.where(keep, ids, 0), torch.where(keep, w, 0.0),
                                   SHAPE.act_limit)
    assert out.dtype == torch.float32 and out.shape == (40, SHAPE.hidden)
    assert gpu_checks.rel_err(out, ref) <= 3e-3


def test_heavy_experts_take_our_tiles_in_exllamav3s_plan(monkeypatch):
    # 300 tokens with expert 1 on every token: above exl3_moe's 128 rows, so apply_fused runs it through
    # apply_experts, the rest through exl3_moe (its CPU stand-in); the sum matches the exact reference.
    layer = _layer(monkeypatch, "ours")
    seen = []
    real = layer.prefill.apply_experts
    monkeypatch.setattr(layer.prefill, "apply_experts", lambda *a: (seen.append(a[3]), real(*a)))
    gen = torch.Generator().manual_seed(4)
    x, ids, w = gpu_checks.random_routing(SHAPE, 300, gen, "cpu", skew_expert=1, skew=1.0)
    out = layer.apply_fused(x.half(), ids, w)
    counts = torch.bincount(ids.reshape(-1), minlength=SHAPE.experts).tolist()
    assert seen == [[e for e, c in enumerate(counts) if c > runtime.FUSED_ROWS]] and 1 in seen[0]
    ref = gpu_checks.reference_moe(_dense(layer), x.half(), ids, w, SHAPE.act_limit)
    assert gpu_checks.rel_err(out, ref) <= 3e-3


def test_layers_of_one_shape_share_the_decode_scratch(monkeypatch):
    # One scratch per shape, not per layer: a model's ~45 MoE layers would otherwise hold 45 x 806 MB.
    layer = _layer(monkeypatch, "ours")
    a, b = (prefill_moe.PrefillExperts(layer.gate, layer.up, layer.down, codebook=SHAPE.codebook,
                                       ext=exl3_cpu_kernels.EXLLAMAV3, tile_experts=4) for _ in range(2))
    assert a.scratch(0)["gate"].data_ptr() == b.scratch(0)["gate"].data_ptr()
    assert a.scratch(1)["gate"].data_ptr() != a.scratch(0)["gate"].data_ptr()


def test_the_kernels_hadamard_is_the_exact_plus_minus_one_matrix():
    # The epilogue products multiply by +-1 exactly and scale by 1/sqrt(128) once, in fp32.
    had = prefill_gemm.hadamard_pm1(torch.device("cpu"))
    assert had.dtype == torch.float16 and set(had.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(had.float() @ had.float(), HADAMARD_BLOCK * torch.eye(HADAMARD_BLOCK))
    assert torch.allclose(had.float() * prefill_gemm.HADAMARD_SCALE, hadamard_128(), rtol=0, atol=1e-7)


def test_rotated_inputs_only_for_the_selected_experts():
    # The plan path rotates its heavy experts' rows only; other rows (light experts, other ranks' bin E) stay unset.
    gen = torch.Generator().manual_seed(6)
    x16 = torch.randn((3, 2 * HADAMARD_BLOCK), generator=gen).half()
    tok, exp = torch.tensor([0, 2, 1, 0]), torch.tensor([0, 0, 1, 2])
    selected = torch.tensor([0, 1, 0], dtype=torch.int32)  # expert 1 of 2 (bin 2: other ranks)
    suh = torch.randn((2, 2 * HADAMARD_BLOCK), generator=gen).half()
    xg, xu = torch.zeros((4, 2 * HADAMARD_BLOCK)).half(), torch.zeros((4, 2 * HADAMARD_BLOCK)).half()
    prefill_gemm.rotate_inputs_reference(x16, tok, exp, selected, suh, -suh, xg, xu)
    assert xg[[0, 1, 3]].abs().sum() == 0 and torch.equal(xg[2], -xu[2])
    expected = (x16[1].float() * suh[1].float()).view(2, HADAMARD_BLOCK) @ hadamard_128()
    assert torch.allclose(xg[2].float(), expected.flatten(), atol=2e-3)
