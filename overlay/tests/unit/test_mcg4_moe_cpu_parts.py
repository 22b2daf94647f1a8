"""CPU-safe parts of our K=4 mcg decode kernels: numerics of what they multiply by, which experts they take,
launch shapes, the kernel switch, and the benchmark's argument handling.

The kernels run on a GPU only (overlay/gpu/check_cuda_moe.py, overlay/benchmarks/; results committed).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from glm53_overlay.exl3 import mcg4_moe, packing, runtime
from glm53_overlay.exl3.codebook import decode_states

def _projection(experts: int, k: int, n: int, bits: int = 4) -> packing.PackedProjection:
    trellis = torch.zeros((experts, k // 16, n // 16, 16 * bits), dtype=torch.int16)
    return packing.PackedProjection(
        trellis, torch.ones(experts, k, dtype=torch.float16), torch.ones(experts, n, dtype=torch.float16), bits
    )


def _layer(hidden: int = 256, inter: int = 128, bits: tuple[int, int, int] = (4, 4, 4)):
    return (_projection(2, hidden, inter, bits[0]), _projection(2, hidden, inter, bits[1]),
            _projection(2, inter, hidden, bits[2]))


def test_exact_values_round_to_the_reference_decoder_and_stay_within_half_an_ulp():
    states = torch.arange(1 << 16)
    exact = mcg4_moe.exact_mcg_values(states)
    reference = decode_states(states, "mcg")
    # The reference rounds lo + hi to fp16 once; our kernels keep the fp32 sum.
    assert torch.equal(exact.half(), reference)
    ulp = torch.where(reference == 0, torch.tensor(2.0**-24), reference.float().abs() * 2.0**-10)
    assert float(((exact - reference.float()).abs() / ulp).max()) <= 0.5 + 1e-6


def test_takes_k4_mcg_experts_only():
    assert mcg4_moe.unsupported_reason(*_layer(), "mcg") is None
    assert "codebook 'mul1'" in mcg4_moe.unsupported_reason(*_layer(), "mul1")
    assert "down experts are K=3" in mcg4_moe.unsupported_reason(*_layer(bits=(4, 4, 3)), "mcg")
    assert "hidden size 192" in mcg4_moe.unsupported_reason(*_layer(hidden=192), "mcg")
    assert "intermediate size 8320" in mcg4_moe.unsupported_reason(*_layer(inter=8320), "mcg")


def test_mcg4_experts_refuse_unsupported_experts_before_building_anything():
    with pytest.raises(ValueError, match="K=3"):
        mcg4_moe.Mcg4Experts(*_layer(bits=(3, 3, 3)), act_limit=0.0)


H200 = mcg4_moe.H200_SHAPES


@pytest.mark.parametrize(("tokens", "shape"), [(0, H200[1]), (1, H200[1]), (7, H200[1]), (8, H200[8]), (64, H200[8])])
def test_launch_shape_takes_the_largest_tuned_entry_at_or_below(tokens, shape):
    assert mcg4_moe.launch_shape(tokens, (9, 0)) == shape


@pytest.mark.parametrize(("capability", "allowed"), [
    ((9, 0), True), ((10, 0), True), ((10, 3), True),  # Hopper, datacenter Blackwell
    ((12, 0), False), ((12, 1), False),  # SM12x (GB10 is 12.1): PDL races the KDA state kernels there
    ((8, 9), False), ((8, 0), False), (None, False),  # no PDL in the hardware; not a CUDA device
])
def test_pdl_only_on_sm9x_and_sm10x(capability, allowed):
    assert mcg4_moe.pdl_allowed(capability) is allowed
    assert all(mcg4_moe.launch_shape(t, capability).pdl is allowed for t in (1, 8, 64))


def test_sm121_runs_the_h200_shapes_as_a_stated_fallback():
    table, source = mcg4_moe.shapes_for((12, 1))
    assert table is H200
    assert source == "H200 (sm_90) shapes as the fallback on sm_121 (not tuned there)"
    for tokens in (1, 8):
        shape = mcg4_moe.launch_shape(tokens, (12, 1))
        assert (shape.gate_up_warps, shape.down_warps) == (H200[tokens].gate_up_warps, H200[tokens].down_warps)
    assert mcg4_moe.shapes_for((9, 0))[1] == "tuned on sm_90"


class _RecordingExtension:
    """Records the launch options `Mcg4Experts.apply` passes to the kernels (no kernels run)."""

    def __init__(self) -> None:
        self.launches: list[tuple[int, int, bool]] = []

    def mcg4_moe(self, *args) -> None:
        gate_up_warps, down_warps, pdl, _stream = args[-4:]
        self.launches.append((gate_up_warps, down_warps, pdl))


@pytest.mark.parametrize(("capability", "pdl"), [((9, 0), True), ((12, 1), False)])
def test_apply_passes_pdl_only_where_allowed_even_when_a_shape_asks_for_it(monkeypatch, capability, pdl):
    ext = _RecordingExtension()
    monkeypatch.setattr(mcg4_moe, "load_extension", lambda: ext)
    experts = mcg4_moe.Mcg4Experts(*_layer(), act_limit=0.0)
    experts.capability = capability  # what device_capability reads on that GPU
    x, ids, w = torch.zeros((1, 256), dtype=torch.bfloat16), torch.zeros((1, 2), dtype=torch.int64), torch.ones((1, 2))
    experts.apply(x, ids, w)
    experts.apply(x, ids, w, mcg4_moe.LaunchShape(gate_up_warps=16, down_warps=4, pdl=True))
    assert ext.launches == [(8, 8, pdl), (16, 4, pdl)]


def test_a_cpu_device_has_no_capability_and_no_pdl():
    assert mcg4_moe.device_capability(torch.device("cpu")) is None
    assert mcg4_moe.launch_shape(1, None).pdl is False


def test_launch_shape_names_a_bad_warp_count():
    with pytest.raises(ValueError, match=r"down_warps=5: expected one of \(4, 8, 16\)"):
        mcg4_moe.LaunchShape(gate_up_warps=8, down_warps=5).check()


def test_decode_kernel_switch(monkeypatch):
    monkeypatch.delenv(runtime.DECODE_KERNEL_ENV, raising=False)
    assert runtime.decode_kernel_choice() == "ours"
    monkeypatch.setenv(runtime.DECODE_KERNEL_ENV, "exllamav3")
    assert runtime.decode_kernel_choice() == "exllamav3"
    monkeypatch.setenv(runtime.DECODE_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="GLM53_EXL3_MOE_DECODE='fast': expected one of ours, exllamav3"):
        runtime.decode_kernel_choice()


def test_the_kernel_source_ships_with_the_package():
    assert mcg4_moe.SOURCE.is_file()
    assert "mcg4_moe" in mcg4_moe.SOURCE.read_text()


@pytest.mark.parametrize("script", ["bench_moe", "tune_mcg4", "kernel_times"])
def test_benchmarks_refuse_bad_token_counts_before_touching_a_gpu(script, monkeypatch, capsys):
    module = importlib.import_module(script)  # benchmarks/ is on pytest's pythonpath
    monkeypatch.setattr(sys, "argv", [script, "--tokens", "0"])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2
    assert "--tokens must be positive" in capsys.readouterr().err


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch may build the kernels here")
def test_a_failed_build_says_how_to_run_without_our_kernels(monkeypatch, tmp_path):
    # A CPU torch has no CUDA toolkit: its JIT refuses the .cu source, and the error names the way out.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    mcg4_moe.load_extension.cache_clear()
    try:
        with pytest.raises(mcg4_moe.Mcg4Unavailable, match="GLM53_EXL3_MOE_DECODE=exllamav3 runs without it"):
            mcg4_moe.load_extension()
    finally:
        mcg4_moe.load_extension.cache_clear()
