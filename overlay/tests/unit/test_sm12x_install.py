"""Which fixes a process gets: SM12x only, checked vLLM releases only, each target patched on first import."""

from __future__ import annotations

import pytest

from glm53_overlay import sm12x
from glm53_overlay.registration import register_sm12x_fixes
from glm53_overlay.spec import on_import
from glm53_overlay.selfcheck import CHECKS, run_check
from glm53_overlay.vllm_compat import VllmInstall, find_vllm


@pytest.fixture(autouse=True)
def fresh_status(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sm12x, "_status", {})


def test_off_sm12x_every_fix_is_not_needed():
    install = find_vllm()
    assert install is not None
    for capability, device in ((None, "no CUDA device"), ((9, 0), "sm_90")):
        sm12x._status.clear()
        states = sm12x.install_fixes(install, capability)
        assert [s.name for s in states] == sm12x.fix_names()
        assert all(s.state == sm12x.NOT_NEEDED and s.detail.startswith(device) for s in states)


def test_an_unchecked_vllm_release_fails_loudly_on_sm12x():
    states = sm12x.install_fixes(VllmInstall("vllm", "0.34.0"), (12, 1))
    assert all(s.state == sm12x.FAILED and "0.34.0 is not a release" in s.detail for s in states)


def test_on_sm12x_a_fix_waits_for_its_target_module(monkeypatch: pytest.MonkeyPatch):
    patched = []
    monkeypatch.setattr(on_import, "when_imported", lambda name, patch: patched.append(name))
    states = sm12x.install_fixes(VllmInstall("vllm", "0.33.1"), (12, 1))
    assert [s.state for s in states] == [sm12x.PENDING] * len(states)
    assert patched == ["vllm.platforms.cuda", "vllm.model_executor.layers.indexer_topk",
                       "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120",
                       "vllm.models.glm5next.common.model", "vllm.v1.attention.backends.mla.indexer"]


def test_the_cpu_plugin_registers_no_fix_and_selfcheck_lists_each():
    assert register_sm12x_fixes() is None
    results = {r.name: r for r in map(run_check, CHECKS) if r.name.startswith("sm12x_")}
    assert sorted(results) == sorted("sm12x_" + n.replace("-", "_") for n in sm12x.fix_names())
    assert all(r.ok and r.detail.startswith("not needed: no CUDA device") for r in results.values())
