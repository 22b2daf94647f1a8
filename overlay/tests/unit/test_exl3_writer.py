"""The EXL3 checkpoint writer: packed tensors decode exactly to the twin, at the replaced weights' scale,
with exllamav3's ledger; bad arguments are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm53_overlay.exl3.codebook import codebook_from_marker
from glm53_overlay.exl3.reference import dequantize
from glm53_overlay.exl3.writer import quantize_checkpoint

SHAPES = {"model.layers.0.mlp.experts.0.gate_proj.weight": (64, 128),  # out 64: padded to 128 in storage
          "model.layers.0.mlp.experts.0.down_proj.weight": (128, 64),
          "model.layers.0.self_attn.o_proj.weight": (128, 128)}


def _source(root: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    root.mkdir()
    tensors = {name: (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16) for name, shape in SHAPES.items()}
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"architectures": ["X"], "hidden_size": 128}))
    (root / "tokenizer.json").write_text("{}")
    return root


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize(("bits", "codebook"), [(4, "mcg"), (2.5, "mul1"), (3, "3inst")])
def test_packed_experts_decode_exactly_to_the_twin(tmp_path: Path, bits: float, codebook: str) -> None:
    written = quantize_checkpoint(_source(tmp_path / "src"), tmp_path / "exl3", tmp_path / "twin", bits=bits,
                                  codebook=codebook)  # type: ignore[arg-type]
    assert written.quantized_modules == ("model.layers.0.mlp.experts.0.down_proj", "model.layers.0.mlp.experts.0.gate_proj")
    exl3, twin, source = _read(written.exl3_dir), _read(written.twin_dir), _read(tmp_path / "src")
    assert torch.equal(exl3["model.layers.0.self_attn.o_proj.weight"], twin["model.layers.0.self_attn.o_proj.weight"])
    for module in written.quantized_modules:
        assert module + ".weight" not in exl3
        marker = codebook_from_marker(exl3.get(module + ".mcg"), exl3.get(module + ".mul1"))
        assert marker == codebook
        w = dequantize(exl3[module + ".trellis"], exl3[module + ".suh"], exl3[module + ".svh"], codebook=marker)
        out, inp = SHAPES[module + ".weight"]
        assert torch.equal(w.t()[:out, :inp].to(torch.bfloat16), twin[module + ".weight"])
        # The padding decodes to exact zeros, and the weight keeps the RMS of the one it replaced (±2%).
        assert not w.t()[out:].any() and not w.t()[:, inp:].any()
        rms = lambda t: float(t.float().pow(2).mean().sqrt())  # noqa: E731
        assert rms(twin[module + ".weight"]) == pytest.approx(rms(source[module + ".weight"]), rel=0.02)
    config = json.loads((written.exl3_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "exl3", "version": "glm53-overlay-writer",
                                             "bits": float(bits), "codebook": codebook}
    ledger = json.loads((written.exl3_dir / "quantization_config.json").read_text())["tensor_storage"]
    entry = ledger["model.layers.0.mlp.experts.0.gate_proj"]
    assert entry["quant_format"] == "exl3" and entry["bits_per_weight"] == bits
    assert entry["stored_tensors"]["model.layers.0.mlp.experts.0.gate_proj.trellis"]["shape"] == [8, 8, int(16 * bits)]
    assert "quant_format" not in ledger["model.layers.0.self_attn.o_proj"]
    assert (written.twin_dir / "tokenizer.json").exists() and not (written.twin_dir / "quantization_config.json").exists()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    source = _source(tmp_path / "src")
    with pytest.raises(ValueError, match="mul1"):
        quantize_checkpoint(source, tmp_path / "a", tmp_path / "b", bits=2.5, codebook="mcg")
    with pytest.raises(ValueError, match="bits"):
        quantize_checkpoint(source, tmp_path / "a", tmp_path / "b", bits=9)
    with pytest.raises(ValueError, match="matches"):
        quantize_checkpoint(source, tmp_path / "a", tmp_path / "b", modules=r"\.nothing$")
