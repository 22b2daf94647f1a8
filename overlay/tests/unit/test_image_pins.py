"""The GB10 image pins: what docker/Dockerfile installs, what the selfcheck reports and refuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from glm53_overlay import image_pins, selfcheck
from glm53_overlay.image_pins import PINS

DOCKERFILE = Path(__file__).resolve().parents[3] / "docker" / "Dockerfile"
NCCL, FLASHINFER, CUTLASS = PINS


def test_the_dockerfile_installs_exactly_the_pins_the_selfcheck_judges():
    found = re.search(r'^ARG GPU_PINS="([^"]*)"$', DOCKERFILE.read_text(), re.MULTILINE)
    assert found is not None
    assert found.group(1).split() == [pin.spec for pin in PINS]
    assert [pin.spec for pin in PINS] == ["nvidia-nccl-cu13==2.30.7", "flashinfer-python==0.6.18",
                                          "nvidia-cutlass-dsl[cu13]==4.6.2"]


@pytest.mark.parametrize("pin, version, bad", [
    (NCCL, "2.30.7", None), (NCCL, "2.32.3", None), (NCCL, "2.29.7", "known bad"),
    (NCCL, "2.30.7.dev20261101", "pre-release"), (NCCL, "2.28.9", "older than 2.30.7"),
    (FLASHINFER, "0.6.18", None), (FLASHINFER, "0.6.18.post1", None), (FLASHINFER, "0.6.17", "known bad"),
    (FLASHINFER, "0.6.17.post1", "known bad"), (CUTLASS, "4.6.2", None), (CUTLASS, "4.6.1", "older"),
    (CUTLASS, None, "not installed"), (CUTLASS, "banana", "not a release version"),
])
def test_each_version_is_judged(pin, version, bad):
    why = image_pins.judge(pin, version)
    assert (why is None) if bad is None else (why is not None and bad in why), why


def test_the_report_names_every_version_and_fails_on_a_bad_one(monkeypatch: pytest.MonkeyPatch):
    held = {"nvidia-nccl-cu13": "2.30.7", "flashinfer-python": "0.6.17", "nvidia-cutlass-dsl": "4.6.2"}
    monkeypatch.setattr(image_pins, "installed", held.get)
    ok, detail = image_pins.report()
    assert not ok and detail.startswith("nvidia-nccl-cu13 2.30.7, flashinfer-python 0.6.17, nvidia-cutlass-dsl 4.6.2;")
    assert "NaN" in detail
    held["flashinfer-python"] = "0.6.18"
    assert image_pins.report() == (True, "nvidia-nccl-cu13 2.30.7, flashinfer-python 0.6.18, nvidia-cutlass-dsl 4.6.2")


def test_the_selfcheck_skips_the_pins_on_a_cpu_image_and_reports_the_versions(monkeypatch: pytest.MonkeyPatch):
    result = selfcheck.run_check(selfcheck.check_gb10_image_pins)
    assert result.skipped and "CPU image" in result.detail
    assert {pin.distribution for pin in PINS} <= set(selfcheck.versions())
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    result = selfcheck.run_check(selfcheck.check_gb10_image_pins)
    assert not result.ok and "nvidia-nccl-cu13 is not installed" in result.detail
