"""The vLLM side of the ablation: which loaded model gets edited, and that a load path which skipped the
edit is refused. Uses vLLM's config context with stand-in configs; the real load runs in the slow e2e test."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from glm53_overlay.ablation.hook import ablating_load_weights, checked_load_model
from glm53_overlay.ablation.settings import AblationSettingError, AblationSettings
from glm53_overlay.registration import register_ablation_hook

import vllm.config as vllm_config_module

HIDDEN, LAYERS = 16, 2


def _model_config() -> SimpleNamespace:
    return SimpleNamespace(get_hidden_size=lambda: HIDDEN, hf_text_config=SimpleNamespace(num_hidden_layers=LAYERS))


def _model(mtp: bool = False) -> torch.nn.Module:
    layers = torch.nn.ModuleDict()
    for layer in range(LAYERS + int(mtp)):
        block = torch.nn.Module()
        attn_parent = torch.nn.Module() if layer >= LAYERS else block
        if layer >= LAYERS:
            block.mtp_block = attn_parent
        attn_parent.self_attn = torch.nn.Module()
        attn_parent.self_attn.o_proj = torch.nn.Linear(8, HIDDEN, bias=False)
        layers[str(layer)] = block
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = layers
    return model


@pytest.fixture
def settings(tmp_path: Path) -> AblationSettings:
    torch.save({"directions": torch.ones(HIDDEN)}, tmp_path / "d.pt")
    return AblationSettings(enabled=True, method="proj", layers=(0, 1), alpha=1.0, direction=tmp_path / "d.pt")


def _serving(monkeypatch: pytest.MonkeyPatch, target: Any, draft: Any = None, method: str = "mtp") -> None:
    spec = SimpleNamespace(draft_model_config=draft, method=method) if draft is not None else None
    current = SimpleNamespace(model_config=target, speculative_config=spec)
    monkeypatch.setattr(vllm_config_module, "get_current_vllm_config_or_none", lambda: current)


def _load(settings: AblationSettings, model: torch.nn.Module, model_config: Any) -> torch.nn.Module:
    ablating_load_weights(lambda self, model, config: None, settings)(None, model, model_config)
    return model


def _edited(model: torch.nn.Module, layer: int) -> bool:
    o_proj = model.model.layers[str(layer)]
    o_proj = getattr(o_proj, "mtp_block", o_proj).self_attn.o_proj
    return float((torch.ones(HIDDEN) @ o_proj.weight.detach()).abs().max()) < 1e-4


def test_target_is_edited(monkeypatch: pytest.MonkeyPatch, settings: AblationSettings) -> None:
    target = _model_config()
    _serving(monkeypatch, target)
    model = _load(settings, _model(), target)
    assert _edited(model, 0) and _edited(model, 1)


@pytest.mark.parametrize("include_mtp, method, edited", [(False, "mtp", False), (True, "mtp", True),
                                                          (True, "dflash", False)])
def test_draft_is_edited_only_when_it_is_included_mtp(
    monkeypatch: pytest.MonkeyPatch, settings: AblationSettings, include_mtp: bool, method: str, edited: bool,
) -> None:
    draft = _model_config()
    _serving(monkeypatch, _model_config(), draft, method)
    settings = replace(settings, include_mtp=include_mtp)
    model = _load(settings, _model(mtp=True), draft)
    assert _edited(model, LAYERS) is edited
    assert not _edited(model, 0)


def test_load_outside_a_config_context_is_refused(monkeypatch: pytest.MonkeyPatch, settings: AblationSettings) -> None:
    monkeypatch.setattr(vllm_config_module, "get_current_vllm_config_or_none", lambda: None)
    with pytest.raises(AblationSettingError, match="^glm53_ablation_enabled: .*cannot tell target from draft"):
        _load(settings, _model(), _model_config())


def test_load_path_that_skipped_the_edit_is_refused(
    monkeypatch: pytest.MonkeyPatch, settings: AblationSettings,
) -> None:
    target = _model_config()
    _serving(monkeypatch, target)
    loader = SimpleNamespace(load_config=SimpleNamespace(load_format="sharded_state"))
    with pytest.raises(AblationSettingError, match="'sharded_state'.*bypasses the ablation hook"):
        checked_load_model(lambda self, vllm_config, model_config: _model(), settings)(loader, None, target)
    edited = checked_load_model(lambda self, vllm_config, model_config: _load(settings, _model(), model_config),
                                settings)(loader, None, target)
    assert _edited(edited, 0)


def test_registration_refuses_bad_settings_and_skips_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLM53_ABLATION_ENABLED", "0")
    assert register_ablation_hook() is None
    monkeypatch.setenv("GLM53_ABLATION_ENABLED", "1")
    monkeypatch.setenv("GLM53_ABLATION_DIRECTION", "/models/direction.pt")
    monkeypatch.setenv("GLM53_ABLATION_LAYERS", "9-3")
    with pytest.raises(AblationSettingError, match="^glm53_ablation_layers: "):
        register_ablation_hook()
