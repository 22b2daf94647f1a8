"""Refusal-direction ablation: the projection against a float64 projector matrix, TP-shard invariance,
settings and file validation, and the donor fetch/transplant path on local files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import fsspec
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm53_overlay.ablation import direction_residual, project_out
from glm53_overlay.ablation.direction import load_direction
from glm53_overlay.ablation.donor import MANIFEST_NAME, o_proj_tensor_name, read_manifest
from glm53_overlay.ablation.donor_fetch import INDEX_NAME, fetch_donor
from glm53_overlay.ablation.edit import ablate_model
from glm53_overlay.ablation.safetensors_ranges import read_safetensors_header, read_tensor_bytes
from glm53_overlay.ablation.settings import (
    AblationSettingError, AblationSettings, format_layers, parse_ablation_settings, parse_layers,
)

HIDDEN, IN_FEATURES, LAYERS = 64, 48, 4


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _reference_edit(weight: torch.Tensor, direction: torch.Tensor, alpha: float) -> torch.Tensor:
    r = direction.double()[:, None]
    projector = torch.eye(len(direction), dtype=torch.float64) - alpha * (r @ r.T) / (r.T @ r)
    return projector @ weight.double()


# --- projection ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [1.0, 3.0, 0.5])
def test_project_out_matches_float64_projector(alpha: float) -> None:
    g = _generator()
    weight, direction = torch.randn(HIDDEN, IN_FEATURES, generator=g), torch.randn(HIDDEN, generator=g)
    edited = project_out(weight, direction, alpha)
    assert edited.dtype == torch.float32
    torch.testing.assert_close(edited.double(), _reference_edit(weight, direction, alpha), rtol=1e-5, atol=1e-5)


def test_project_out_keeps_bf16_and_rounds_once() -> None:
    g = _generator()
    weight = torch.randn(HIDDEN, IN_FEATURES, generator=g).to(torch.bfloat16)
    direction = torch.randn(HIDDEN, generator=g)
    edited = project_out(weight, direction, 3.0)
    assert edited.dtype == torch.bfloat16
    # fp32 math then one rounding: within one bf16 ulp of the exact result.
    exact = _reference_edit(weight.float(), direction, 3.0)
    torch.testing.assert_close(edited.double(), exact, rtol=2**-7, atol=1e-6)


def test_alpha_one_removes_the_direction_exactly() -> None:
    g = _generator()
    weight, direction = torch.randn(HIDDEN, IN_FEATURES, generator=g), torch.randn(HIDDEN, generator=g) * 7
    assert direction_residual(weight, direction) > 0.1
    assert direction_residual(project_out(weight, direction, 1.0), direction) < 1e-5


def test_edits_of_tp_shards_concatenate_to_the_edit_of_the_full_weight() -> None:
    g = _generator()
    weight, direction = torch.randn(HIDDEN, IN_FEATURES, generator=g), torch.randn(HIDDEN, generator=g)
    full = project_out(weight, direction, 3.0)
    for tp in (2, 4):
        shards = [project_out(shard, direction, 3.0) for shard in weight.chunk(tp, dim=1)]
        torch.testing.assert_close(torch.cat(shards, dim=1), full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("direction, message", [
    (torch.zeros(HIDDEN), "zero norm"),
    (torch.full((HIDDEN,), float("nan")), "non-finite"),
    (torch.ones(HIDDEN + 1), "expected"),
])
def test_project_out_rejects_bad_directions(direction: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        project_out(torch.ones(HIDDEN, IN_FEATURES), direction, 1.0)


# --- settings -----------------------------------------------------------------------------------------------

def test_layers_accept_ranges_and_lists_inclusive() -> None:
    assert parse_layers("15-17") == (15, 16, 17)
    assert parse_layers("1, 3,5-7,3") == (1, 3, 5, 6, 7)
    assert format_layers((1, 3, 5, 6, 7)) == "1,3,5-7"


@pytest.mark.parametrize("text", ["", "a-3", "7-5", "-3", "1,,2", "3-"])
def test_bad_layers_name_the_ansible_setting(text: str) -> None:
    with pytest.raises(AblationSettingError, match="^glm53_ablation_layers: "):
        parse_layers(text)


def test_disabled_ablation_reads_nothing_else() -> None:
    assert parse_ablation_settings({"GLM53_ABLATION_METHOD": "bogus"}) == AblationSettings(enabled=False)
    assert not parse_ablation_settings({"GLM53_ABLATION_ENABLED": "0"}).enabled


def test_enabled_settings_with_defaults() -> None:
    settings = parse_ablation_settings({"GLM53_ABLATION_ENABLED": "1", "GLM53_ABLATION_DIRECTION": "/d/dir.pt"})
    assert settings == AblationSettings(enabled=True, method="proj", layers=tuple(range(15, 46)), alpha=3.0,
                                        direction=Path("/d/dir.pt"), include_mtp=False, donor_dir=None)


@pytest.mark.parametrize("env, setting", [
    ({"GLM53_ABLATION_ENABLED": "yes"}, "glm53_ablation_enabled"),
    ({"GLM53_ABLATION_METHOD": "erase"}, "glm53_ablation_method"),
    ({"GLM53_ABLATION_ALPHA": "strong"}, "glm53_ablation_alpha"),
    ({"GLM53_ABLATION_ALPHA": "nan"}, "glm53_ablation_alpha"),
    ({"GLM53_ABLATION_DIRECTION": ""}, "glm53_ablation_direction"),
    ({"GLM53_ABLATION_DIRECTION": "dir.pt"}, "glm53_ablation_direction"),
    ({"GLM53_ABLATION_METHOD": "transplant"}, "glm53_ablation_donor_dir"),
    ({"GLM53_ABLATION_INCLUDE_MTP": "2"}, "glm53_ablation_include_mtp"),
])
def test_bad_settings_name_the_ansible_setting(env: dict[str, str], setting: str) -> None:
    base = {"GLM53_ABLATION_ENABLED": "1", "GLM53_ABLATION_DIRECTION": "/d/dir.pt"}
    with pytest.raises(AblationSettingError, match=f"^{setting}: "):
        parse_ablation_settings(base | env)


# --- direction file -----------------------------------------------------------------------------------------

def _save(path: Path, content: object) -> Path:
    torch.save(content, path)
    return path


def test_direction_file_accepts_1d_and_1xh(tmp_path: Path) -> None:
    direction = torch.randn(HIDDEN, generator=_generator()).to(torch.bfloat16)
    for name, stored in (("flat.pt", direction), ("row.pt", direction[None, :])):
        loaded = load_direction(_save(tmp_path / name, {"directions": stored}), HIDDEN)
        assert loaded.dtype == torch.float32 and torch.equal(loaded, direction.float())


@pytest.mark.parametrize("content, message", [
    ({"direction": torch.ones(HIDDEN)}, "no 'directions' key"),
    (torch.ones(HIDDEN), "no 'directions' key"),
    ({"directions": torch.ones(HIDDEN - 1)}, "does not match hidden size"),
    ({"directions": torch.ones(2, HIDDEN)}, "does not match hidden size"),
    ({"directions": torch.zeros(HIDDEN)}, "zero or not finite"),
    ({"directions": torch.full((HIDDEN,), float("nan"))}, "zero or not finite"),
    ({"directions": [1.0] * HIDDEN}, "is a list"),
])
def test_bad_direction_files_are_refused(tmp_path: Path, content: object, message: str) -> None:
    with pytest.raises(AblationSettingError, match=f"^glm53_ablation_direction: .*{message}"):
        load_direction(_save(tmp_path / "d.pt", content), HIDDEN)


def test_missing_direction_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AblationSettingError, match="does not exist"):
        load_direction(tmp_path / "absent.pt", HIDDEN)


# --- editing a model ----------------------------------------------------------------------------------------

class _OProj(torch.nn.Module):
    """Stands in for vLLM's RowParallelLinear: this rank's [out, in/tp] shard plus its TP position."""

    def __init__(self, weight: torch.Tensor, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        self.tp_rank, self.tp_size = tp_rank, tp_size


def _fake_model(weights: dict[int, torch.Tensor], tp_rank: int = 0, tp_size: int = 1) -> torch.nn.Module:
    layers = torch.nn.ModuleDict()
    for layer, weight in weights.items():
        block = torch.nn.Module()
        block.self_attn = torch.nn.Module()
        block.self_attn.o_proj = _OProj(weight, tp_rank, tp_size)
        layers[str(layer)] = block
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = layers
    return model


def _weights(dtype: torch.dtype = torch.bfloat16) -> dict[int, torch.Tensor]:
    g = _generator()
    return {layer: torch.randn(HIDDEN, IN_FEATURES, generator=g).to(dtype) for layer in range(LAYERS)}


def _proj_settings(direction: Path, layers: str, alpha: float = 3.0) -> AblationSettings:
    return AblationSettings(enabled=True, method="proj", layers=parse_layers(layers), alpha=alpha, direction=direction)


def test_ablate_model_edits_only_the_selected_layers(tmp_path: Path) -> None:
    direction = torch.randn(HIDDEN, generator=_generator())
    path = _save(tmp_path / "d.pt", {"directions": direction})
    weights = _weights(torch.float32)
    model = _fake_model(weights)
    result = ablate_model(model, _proj_settings(path, "1-2", alpha=1.0), role="target",
                          hidden_size=HIDDEN, num_hidden_layers=LAYERS)
    for layer in range(LAYERS):
        weight = model.model.layers[str(layer)].self_attn.o_proj.weight
        expected = project_out(weights[layer], direction, 1.0) if layer in (1, 2) else weights[layer]
        assert torch.equal(weight, expected)
    assert result.layers == (1, 2) and result.residual_max is not None and result.residual_max < 1e-5
    assert result.log_line(rank=1).startswith(
        "glm53-ablation: rank=1 model=target method=proj layers=1-2 (2 edited) alpha=1.0 residual_max=")


def test_layer_range_outside_the_model_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "d.pt", {"directions": torch.ones(HIDDEN)})
    with pytest.raises(AblationSettingError, match=r"^glm53_ablation_layers: layers 4-5 are outside the model's 0-3"):
        ablate_model(_fake_model(_weights()), _proj_settings(path, "2-5"), role="target",
                     hidden_size=HIDDEN, num_hidden_layers=LAYERS)


def test_enabled_ablation_that_edits_nothing_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "d.pt", {"directions": torch.ones(HIDDEN)})
    partial = _fake_model({0: _weights()[0]})  # a pipeline stage holding layer 0 only
    with pytest.raises(AblationSettingError, match="edits nothing"):
        ablate_model(partial, _proj_settings(path, "2-3"), role="target", hidden_size=HIDDEN, num_hidden_layers=LAYERS)


# --- donor fetch (range reads) and transplant ---------------------------------------------------------------

def _write_checkpoint(root: Path, donor: dict[int, torch.Tensor], sharded: bool) -> None:
    tensors = {o_proj_tensor_name(layer): weight for layer, weight in donor.items()}
    tensors |= {f"model.layers.{layer}.mlp.down_proj.weight": torch.ones(8, 8) for layer in donor}
    if not sharded:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for index, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(root / file))
        weight_map |= dict.fromkeys(part, file)
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_header_and_range_reads_match_the_safetensors_library(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    tensors = {"a": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(5, dtype=torch.float32)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    data = path.read_bytes()
    header = read_safetensors_header(lambda start, end: data[start:end])
    assert set(header) == {"a", "b"}
    with safe_open(str(path), "pt") as reference:
        for name, location in header.items():
            tensor = reference.get_tensor(name)
            assert location.shape == tuple(tensor.shape)
            raw = read_tensor_bytes(lambda start, end: data[start:end], location)
            assert raw == tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_truncated_safetensors_are_refused() -> None:
    data = struct.pack("<Q", 1000) + b"{}"
    with pytest.raises(ValueError, match="short read"):
        read_safetensors_header(lambda start, end: data[start:end])


@pytest.mark.parametrize("sharded", [False, True])
def test_fetch_donor_reads_only_the_o_projs_and_resumes(tmp_path: Path, sharded: bool) -> None:
    (checkpoint := tmp_path / "hub").mkdir()
    donor = _weights()
    _write_checkpoint(checkpoint, donor, sharded)
    out = tmp_path / "donor"
    fs = fsspec.filesystem("file")
    source = {"repo": "local/test", "revision": "main"}
    assert fetch_donor(fs, str(checkpoint), [1, 2], out, source) == [o_proj_tensor_name(1), o_proj_tensor_name(2)]
    manifest = read_manifest(out)
    assert set(manifest) == {o_proj_tensor_name(1), o_proj_tensor_name(2)}
    with safe_open(str(out / manifest[o_proj_tensor_name(2)].file), "pt") as fetched:
        assert torch.equal(fetched.get_tensor("weight"), donor[2])

    assert fetch_donor(fs, str(checkpoint), [1, 2, 3], out, source) == [o_proj_tensor_name(3)]
    (out / manifest[o_proj_tensor_name(1)].file).write_bytes(b"corrupt")
    assert fetch_donor(fs, str(checkpoint), [1, 2, 3], out, source) == [o_proj_tensor_name(1)]


def _transplant_settings(donor_dir: Path, layers: str) -> AblationSettings:
    return AblationSettings(enabled=True, method="transplant", layers=parse_layers(layers), donor_dir=donor_dir)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_transplant_puts_each_rank_s_slice_of_the_donor_in_place(tmp_path: Path, tp_rank: int) -> None:
    (checkpoint := tmp_path / "hub").mkdir()
    donor = {layer: -w for layer, w in _weights().items()}
    _write_checkpoint(checkpoint, donor, sharded=False)
    fetch_donor(fsspec.filesystem("file"), str(checkpoint), [2, 3], tmp_path / "donor", {})
    half = IN_FEATURES // 2
    shards = {layer: w[:, tp_rank * half:(tp_rank + 1) * half] for layer, w in _weights().items()}
    model = _fake_model(shards, tp_rank=tp_rank, tp_size=2)
    result = ablate_model(model, _transplant_settings(tmp_path / "donor", "2-3"), role="target",
                          hidden_size=HIDDEN, num_hidden_layers=LAYERS)
    assert result.layers == (2, 3) and result.residual_max is None
    for layer in range(LAYERS):
        expected = donor[layer][:, tp_rank * half:(tp_rank + 1) * half] if layer >= 2 else shards[layer]
        assert torch.equal(model.model.layers[str(layer)].self_attn.o_proj.weight, expected)


def test_transplant_with_a_wrong_sha_is_refused(tmp_path: Path) -> None:
    (checkpoint := tmp_path / "hub").mkdir()
    _write_checkpoint(checkpoint, _weights(), sharded=False)
    donor_dir = tmp_path / "donor"
    fetch_donor(fsspec.filesystem("file"), str(checkpoint), [2], donor_dir, {})
    manifest = json.loads((donor_dir / MANIFEST_NAME).read_text())
    manifest["tensors"][o_proj_tensor_name(2)]["sha256"] = "0" * 64
    (donor_dir / MANIFEST_NAME).write_text(json.dumps(manifest))
    model = _fake_model(_weights())
    with pytest.raises(AblationSettingError, match="^glm53_ablation_donor_dir: .*sha256 differs"):
        ablate_model(model, _transplant_settings(donor_dir, "2"), role="target",
                     hidden_size=HIDDEN, num_hidden_layers=LAYERS)
    assert torch.equal(model.model.layers["2"].self_attn.o_proj.weight, _weights()[2])


def test_transplant_of_a_layer_missing_from_the_donor_is_refused(tmp_path: Path) -> None:
    (checkpoint := tmp_path / "hub").mkdir()
    _write_checkpoint(checkpoint, _weights(), sharded=False)
    fetch_donor(fsspec.filesystem("file"), str(checkpoint), [2], tmp_path / "donor", {})
    with pytest.raises(AblationSettingError, match="manifest has no model.layers.3"):
        ablate_model(_fake_model(_weights()), _transplant_settings(tmp_path / "donor", "2-3"), role="target",
                     hidden_size=HIDDEN, num_hidden_layers=LAYERS)
