"""The speculative-decoding glue piece by piece, on CPU: the candidate walk on a hand-made case (against vLLM's
own Triton walk kernel in test_spec_walk_kernel.py), the proposer and config patches on stand-ins, the draft
defaults, the post-import hook, and (with vLLM installed) the GLM aux-hidden-state capture and vLLM's own
EngineArgs."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from glm53_overlay.spec import candidate_walk, draft_defaults, on_import
from glm53_overlay.spec.candidate_walk import greedy_candidate_walk


def test_walk_follows_the_edge_from_the_previous_pick_not_the_unary_argmax() -> None:
    candidates = torch.tensor([[[10, 11], [20, 21]]])
    scores = torch.zeros(1, 2, 2, 2)
    scores[0, 0, 0] = torch.tensor([0.0, 1.0])       # step 0 from the anchor: pick index 1 (token 11)
    scores[0, 1, 0] = torch.tensor([9.0, 0.0])       # row of index 0 would pick 20, but it was not picked
    scores[0, 1, 1] = torch.tensor([0.0, 1.0])       # row of index 1 picks 21
    assert greedy_candidate_walk(scores, candidates).tolist() == [[11, 21]]


class _Selector:
    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
        self.calls.append((ids, unary, hidden, anchors))
        # Edge score = unary; the walk then equals a per-step argmax of the unary logits.
        return unary[:, :, None, :].expand(-1, -1, self.top_k, -1).clone()


class _Draft:
    """Stand-in for DFlash2Qwen3ForCausalLM: top-k of a fixed logit table, and a selector."""

    def __init__(self, logits: torch.Tensor, top_k: int) -> None:
        self.logits = logits
        self.top_k = top_k
        self.model = SimpleNamespace(candidate_selector=_Selector(top_k))

    def compute_candidates(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = (hidden_states @ self.logits).topk(self.top_k, dim=-1)
        return ids, values


def test_patched_proposer_walks_candidates_and_reads_anchors_at_the_block_stride() -> None:
    calls: list[str] = []

    class DFlashProposer:
        def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any) -> Any:
            calls.append("original")
            return hidden_states.argmax(-1), None

    module = ModuleType("fake_dflash")
    module.DFlashProposer = DFlashProposer  # type: ignore[attr-defined]
    candidate_walk.patch_dflash_proposer(module)
    candidate_walk.patch_dflash_proposer(module)  # idempotent
    steps, hidden, vocab = 3, 6, 9
    proposer = DFlashProposer()
    proposer.num_speculative_tokens = steps  # type: ignore[attr-defined]
    proposer.input_ids = torch.tensor([101, 7, 7, 7, 202, 7, 7, 7])  # type: ignore[attr-defined]
    proposer.model = _Draft(torch.randn(hidden, vocab), top_k=4)  # type: ignore[attr-defined]
    rows = torch.randn(2 * steps, hidden)
    tokens, probs = proposer._sample_draft_tokens(rows, None)
    assert probs is None and calls == []
    assert torch.equal(tokens, (rows @ proposer.model.logits).argmax(-1))
    assert proposer.model.model.candidate_selector.calls[0][3].tolist() == [101, 202]

    proposer.model = SimpleNamespace()  # a DFlash1 draft: no candidate head, vLLM's own sampling
    proposer._sample_draft_tokens(rows, None)
    assert calls == ["original"]


def test_v1_refusal_of_candidate_drafts_is_the_only_feature_dropped() -> None:
    class VllmConfig:
        def _get_v1_model_runner_unsupported_features(self) -> list[str]:
            return ["prefill context parallel", candidate_walk.V1_REFUSAL]

    candidate_walk.allow_candidate_drafts_on_v1(VllmConfig)
    candidate_walk.allow_candidate_drafts_on_v1(VllmConfig)
    assert VllmConfig()._get_v1_model_runner_unsupported_features() == ["prefill context parallel"]


def test_int64_ids_cross_a_float_only_all_gather_exactly() -> None:
    def float_only_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        assert tensor.dtype != torch.int64, "shm_all_gather_impl not implemented for 'Long'"
        return torch.cat([tensor, tensor + 1], dim=dim)

    gather = candidate_walk.all_gather_ids_as_float(float_only_all_gather)
    assert candidate_walk.all_gather_ids_as_float(gather) is gather
    ids = torch.tensor([[0, 154879, 2**24 - 2]])
    out = gather(ids, dim=-1)
    assert out.dtype == torch.int64 and out.tolist() == [[0, 154879, 2**24 - 2, 1, 154880, 2**24 - 1]]
    assert gather(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="2\\*\\*24"):
        gather(torch.tensor([2**24]))


@pytest.mark.parametrize("method,draft_kv,target_kv,expected", [
    ("dflash", None, "fp8", "auto"),
    ("dflash", None, "fp8_e4m3", "auto"),
    ("dflash", None, "fp8_ds_mla", "auto"),
    ("dflash", None, "auto", None),
    ("dflash", None, "bfloat16", None),
    ("dflash", "fp8", "fp8", "fp8"),       # an explicit draft setting always wins
    ("mtp", None, "fp8", None),            # MTP layers are the target's own; they share its cache layout
    ("eagle3", None, "fp8", None),
])
def test_draft_kv_cache_dtype(method: str, draft_kv: str | None, target_kv: str, expected: str | None) -> None:
    assert draft_defaults.draft_kv_cache_dtype(method, draft_kv, target_kv) == expected


def _hf(**kwargs: Any) -> SimpleNamespace:
    return SimpleNamespace(architectures=["DFlash2DraftModel"], **kwargs)


@pytest.mark.parametrize("config,changed,is_causal", [
    (_hf(layer_types=["sliding_attention"] * 5), True, False),
    (_hf(dflash_config={"mask_token_id": 3}), True, False),
    (_hf(is_causal=False), False, False),
    (_hf(is_causal=True), False, True),                       # stated: vLLM's reading stands
    (_hf(dflash_config={"causal": True}), False, None),
    (SimpleNamespace(architectures=["DFlashDraftModel"], layer_types=["sliding_attention"]), False, None),
])
def test_dflash2_drafts_become_non_causal_only_when_they_state_nothing(config: Any, changed: bool,
                                                                      is_causal: bool | None) -> None:
    assert draft_defaults.make_dflash2_non_causal(config) is changed
    assert getattr(config, "is_causal", None) is is_causal


def test_engine_args_hook_fills_the_speculative_config() -> None:
    class EngineArgs:
        kv_cache_dtype = "fp8"

        def create_speculative_config(self, target_model_config: Any, target_parallel_config: Any) -> Any:
            return SimpleNamespace(method="dflash", kv_cache_dtype=None,
                                   draft_model_config=SimpleNamespace(hf_config=_hf()))

    draft_defaults.patch_engine_args(EngineArgs)
    draft_defaults.patch_engine_args(EngineArgs)
    spec = EngineArgs().create_speculative_config(None, None)
    assert spec.kv_cache_dtype == "auto" and spec.draft_model_config.hf_config.is_causal is False
    assert draft_defaults.apply_draft_defaults(None, "fp8") == []


def test_patch_runs_at_first_import_or_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "glm53_fake_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []

    def patch(module: ModuleType) -> None:
        seen.append(module.VALUE)
        module.VALUE = 2

    on_import.when_imported("glm53_fake_target", patch)
    assert seen == [] and "glm53_fake_target" not in sys.modules
    module = importlib.import_module("glm53_fake_target")
    assert seen == [1] and module.VALUE == 2
    assert importlib.util.find_spec("glm53_fake_target") is not None  # the hook is gone, finders still work
    on_import.when_imported("glm53_fake_target", patch)
    assert seen == [1, 2]
    sys.modules.pop("glm53_fake_target")


# ---- with vLLM installed -------------------------------------------------------------------------


def test_glm_target_gets_aux_hidden_states_only_where_vllm_lacks_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.models import glm4_moe_lite
    from vllm.model_executor.models.interfaces import supports_eagle3

    from glm53_overlay.spec import glm_aux_hidden

    resolved = glm_aux_hidden.Glm4MoeLiteForCausalLM
    assert supports_eagle3(resolved)
    # vLLM 0.32 lacks it; when a release adds it, the registered name is vLLM's class itself.
    assert (resolved is glm4_moe_lite.Glm4MoeLiteForCausalLM) == supports_eagle3(glm4_moe_lite.Glm4MoeLiteForCausalLM)

    # The recording forward on stand-in layers: aux = hidden + residual at the input of each requested
    # layer, and after the last one (target_layer_ids + 1 == number of layers).
    monkeypatch.setattr(glm_aux_hidden, "get_pp_group", lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True))

    def layer(shift: float) -> Any:
        return lambda positions, h, r: (h * 2 + shift, h if r is None else r + h)

    model = SimpleNamespace(
        layers=[layer(1.0), layer(2.0), layer(3.0)], start_layer=0, end_layer=3,
        aux_hidden_state_layers=(1, 3), embed_input_ids=lambda ids: ids.float()[:, None].expand(-1, 2).clone(),
        norm=lambda h, r: (h + r, None),
    )
    hidden, aux = glm_aux_hidden.Glm4MoeLiteModelWithAux.forward(model, torch.tensor([1, 2]), torch.tensor([0, 1]))
    streams, h, r = [], torch.tensor([[1.0, 1.0], [2.0, 2.0]]), None
    for index, shift in enumerate((1.0, 2.0, 3.0)):
        streams.append(h if r is None else h + r)
        h, r = h * 2 + shift, (h if r is None else r + h)
    streams.append(h + r)
    assert [a.tolist() for a in aux] == [streams[1].tolist(), streams[3].tolist()]
    assert torch.equal(hidden, h + r)
    model.aux_hidden_state_layers = ()
    plain = glm_aux_hidden.Glm4MoeLiteModelWithAux.forward(model, torch.tensor([1, 2]), torch.tensor([0, 1]))
    assert torch.equal(plain, h + r)


def test_aux_model_is_built_only_for_methods_that_read_aux_states() -> None:
    from glm53_overlay.spec.glm_aux_hidden import wants_aux_hidden_states

    for method, wanted in (("dflash", True), ("eagle3", True), ("mtp", False), ("ngram", False)):
        assert wants_aux_hidden_states(SimpleNamespace(speculative_config=SimpleNamespace(method=method))) is wanted
    assert not wants_aux_hidden_states(SimpleNamespace(speculative_config=None))


def test_vllm_engine_args_give_a_dflash2_draft_auto_kv_and_non_causal(tmp_path: Path) -> None:
    """vLLM's own EngineArgs with an fp8 target: the speculative config it builds carries the defaults."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

    from glm53_overlay import register

    register()
    shape = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128, "max_position_embeddings": 512}
    target, draft = tmp_path / "target", tmp_path / "draft"
    for path, config in (
        (target, {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2}),
        # Stated nowhere whether it is causal, all layers sliding: vLLM alone would run it causally.
        (draft, {"architectures": ["DFlash2DraftModel"], "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                 "use_sliding_window": True, "sliding_window": 256,
                 "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0], "conv_kernel_size": 2,
                                   "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 4}}),
    ):
        path.mkdir()
        path.joinpath("config.json").write_text(json.dumps(shape | config))
    args = EngineArgs(model=str(target), skip_tokenizer_init=True, kv_cache_dtype="fp8", max_model_len=256,
                      speculative_config={"method": "dflash", "model": str(draft), "num_speculative_tokens": 3})
    spec = args.create_speculative_config(args.create_model_config(), ParallelConfig())
    # Without the plugin (checked with VLLM_PLUGINS=''): kv_cache_dtype None (the draft inherits fp8) and
    # vLLM resolves this draft causal.
    assert spec.method == "dflash" and spec.kv_cache_dtype == "auto"
    assert spec.draft_model_config.hf_config.is_causal is False
    assert dflash_has_any_non_causal(spec.draft_model_config.hf_config)
