"""CPU-safe parts of the EXL3 CUDA MoE path: byte accounting, argument checks, routing bookkeeping.

The kernels themselves are checked on a GPU by overlay/gpu/check_cuda_moe.py (results in
overlay/gpu/results/); here nothing touches CUDA or exllamav3.
"""

from __future__ import annotations

import pytest
import torch

from glm53_overlay.exl3 import packing, runtime


def _projection(experts: int, k: int, n: int, bits: int = 4) -> packing.PackedProjection:
    trellis = torch.randint(-(1 << 15), 1 << 15, (experts, k // 16, n // 16, 16 * bits), dtype=torch.int32)
    return packing.PackedProjection(
        trellis.to(torch.int16), torch.ones(experts, k, dtype=torch.float16), torch.ones(experts, n, dtype=torch.float16), bits
    )


def test_expert_bytes_counts_trellis_and_scales():
    p = _projection(3, 256, 128)
    # 4 bpw over 256 x 128 weights, plus fp16 suh [256] and svh [128]
    assert p.expert_bytes() == 256 * 128 * 4 // 8 + (256 + 128) * 2


def test_touched_bytes_counts_each_routed_expert_once():
    projections = {"gate": _projection(4, 128, 128), "up": _projection(4, 128, 128), "down": _projection(4, 128, 128)}
    ids = torch.tensor([[0, 1], [1, 2]])
    per_expert = 3 * projections["gate"].expert_bytes()
    assert packing.touched_bytes(projections, ids, 128) == 3 * per_expert + 2 * 128 * 4 + 4 * 12


def test_stack_rejects_mixed_shapes():
    a = (torch.zeros(8, 8, 64, dtype=torch.int16), torch.ones(128), torch.ones(128))
    b = (torch.zeros(8, 16, 64, dtype=torch.int16), torch.ones(128), torch.ones(256))
    with pytest.raises(ValueError, match="differ"):
        packing.PackedProjection.stack([a, b], "cpu")


def test_stack_rejects_unpadded_shape():
    part = (torch.zeros(8, 4, 64, dtype=torch.int16), torch.ones(128), torch.ones(64))
    with pytest.raises(ValueError, match="multiple of 128"):
        packing.PackedProjection.stack([part], "cpu")


def test_routing_tables_group_by_expert_in_stable_order():
    ids = torch.tensor([[2, 0], [0, 5], [2, 1]])
    weights = torch.tensor([[0.5, 0.25], [0.125, 0.75], [0.0625, 1.0]])
    count, token_sorted, weight_sorted = runtime.routing_tables(ids, weights, num_experts=4)
    # expert 5 is outside this rank's 4 experts: it lands in the last bin, sorted last
    assert count.tolist() == [2, 1, 2, 0, 1]
    assert token_sorted.tolist() == [0, 1, 2, 0, 2, 1]
    assert weight_sorted.dtype == torch.float16
    assert weight_sorted.tolist() == [0.25, 0.125, 1.0, 0.5, 0.0625, 0.75]


@pytest.mark.parametrize("projection", ["gate", "up"])
def test_slice_for_rank_splits_gate_up_columns(projection):
    trellis = torch.arange(16 * 32 * 4).view(16, 32, 4).to(torch.int16)
    suh, svh = torch.arange(256.0), torch.arange(512.0)
    t, s, v = packing.slice_for_rank(trellis, suh, svh, projection, rank=1, size=2, width=256)
    assert torch.equal(t, trellis[:, 16:32]) and torch.equal(s, suh) and torch.equal(v, svh[256:512])


def test_slice_for_rank_splits_down_rows():
    trellis = torch.arange(32 * 16 * 4).view(32, 16, 4).to(torch.int16)
    suh, svh = torch.arange(512.0), torch.arange(256.0)
    t, s, v = packing.slice_for_rank(trellis, suh, svh, "down", rank=0, size=2, width=256)
    assert torch.equal(t, trellis[:16]) and torch.equal(s, suh[:256]) and torch.equal(v, svh)


def test_slice_for_rank_refuses_unaligned_split():
    with pytest.raises(ValueError, match="multiple of 128"):
        packing.slice_for_rank(torch.zeros(8, 8, 4), torch.ones(128), torch.ones(128), "gate", 0, 2, 64)


def test_coop_counter_len_matches_exllamav3_formula():
    # exllamav3's block_sparse_mlp: rows*(I//128) + MAX_BSZN*(Ho//128) + 2*rows + 3, rows = MAX_BSZN * top_k
    slots = runtime.DECODE_MAX_TOKENS * 8
    expected = slots * (1024 // 128) + 8 * (4096 // 128) + 2 * slots + 3
    assert runtime.coop_counter_len(slots, 8, 1024, 4096) == expected


def test_unsupported_without_cuda_and_kernels_fail_closed(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU-only test")
    assert runtime.cuda_moe_supported() is False
    runtime.load_kernels.cache_clear()
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(runtime.importlib, "import_module", lambda name: (_ for _ in ()).throw(ImportError(name)))
    with pytest.raises(runtime.Exl3KernelsUnavailable, match="exllamav3"):
        runtime.load_kernels()
    runtime.load_kernels.cache_clear()


def test_kernel_module_missing_a_kernel_is_refused(monkeypatch):
    fake = type("Ext", (), {name: None for name in runtime.REQUIRED_KERNELS if name != "exl3_moe_coop"})
    runtime.load_kernels.cache_clear()
    monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(runtime.importlib, "import_module", lambda name: fake)
    with pytest.raises(runtime.Exl3KernelsUnavailable, match="exl3_moe_coop"):
        runtime.load_kernels()
    runtime.load_kernels.cache_clear()


def test_codebook_3inst_is_refused_before_kernels_load():
    p = _projection(2, 128, 128)
    with pytest.raises(runtime.Exl3KernelsUnavailable, match="3inst"):
        runtime.Exl3CudaExperts(p, p, p, codebook="3inst", top_k=2)


class _Recorder:
    """Stands in for a kernel family: records the token counts it is called with, returns zeros (fp32 like
    exllamav3's wrappers, or x's dtype like ours)."""

    def __init__(self, hidden: int, dtype: torch.dtype | None = torch.float32) -> None:
        self.hidden, self.dtype, self.calls = hidden, dtype, []

    def __call__(self, x, ids, weights, *rest):
        self.calls.append(x.shape[0])
        return torch.zeros((x.shape[0], self.hidden), dtype=self.dtype or x.dtype)


def _dispatching_layer(with_ours: bool) -> runtime.Exl3CudaExperts:
    # Only apply's dispatch is exercised: no kernels, no CUDA (the kernels are checked on a GPU).
    layer = object.__new__(runtime.Exl3CudaExperts)
    layer.hidden, layer.top_k = 64, 2
    layer.ours = type("Ours", (), {"apply": _Recorder(64, dtype=None)})() if with_ours else None
    layer.apply_decode, layer.apply_fused = _Recorder(64), _Recorder(64)
    layer.prefill = None
    return layer


@pytest.mark.parametrize("with_ours", [True, False])
@pytest.mark.parametrize("tokens", [1, 8, 9, 16, 17, 64, 65, 300])
def test_apply_runs_the_kernels_path_for_names(with_ours, tokens):
    layer = _dispatching_layer(with_ours)
    x = torch.zeros((tokens, 64), dtype=torch.bfloat16)
    ids = torch.zeros((tokens, 2), dtype=torch.int64)
    out = layer.apply(x, ids, torch.ones((tokens, 2)))
    assert out.shape == (tokens, 64) and out.dtype == torch.bfloat16
    called = {
        runtime.PATH_OURS: layer.ours.apply.calls if with_ours else [],
        runtime.PATH_COOP: layer.apply_decode.calls,
        runtime.PATH_FUSED: layer.apply_fused.calls,
    }
    path = layer.path_for(tokens)
    assert sum(called[path]) == tokens  # coop in chunks of 8, the others in one call
    assert all(not calls for name, calls in called.items() if name != path)
    if with_ours:
        assert (path == runtime.PATH_OURS) == (tokens <= runtime.MCG4_MAX_TOKENS)
