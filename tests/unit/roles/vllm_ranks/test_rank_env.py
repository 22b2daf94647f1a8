"""Settings the overlay reads from the rank's environment reach it: roles/vllm_ranks/vars/main.yml."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[4]
ENV_COMMON = yaml.safe_load((REPO / "roles/vllm_ranks/vars/main.yml").read_text())["_vllm_ranks_env_common"]
SPEC = yaml.safe_load((REPO / "roles/glm53/meta/argument_specs.yml").read_text())
DENSE_SOURCE = (REPO / "overlay/src/glm53_overlay/exl3/dense.py").read_text()


def _overlay_constant(name: str) -> str:
    match = re.search(rf"^{name} = (.+)$", DENSE_SOURCE, re.MULTILINE)
    assert match, f"{name} not found in glm53_overlay/exl3/dense.py"
    return match.group(1)


@pytest.mark.parametrize("value", ["none", "fp8"])
def test_dense_quantization_is_in_every_ranks_env(value):
    env_name = _overlay_constant("ENV").strip('"')
    template = ENV_COMMON[env_name]
    assert jinja2.Template(template).render(glm53_dense_quantization=value) == value


def test_the_setting_offers_what_the_overlay_accepts():
    option = SPEC["argument_specs"]["main"]["options"]["glm53_dense_quantization"]
    assert tuple(option["choices"]) == ast.literal_eval(_overlay_constant("CHOICES"))
    assert option["default"] == "none"


def test_the_inductor_cache_is_on_the_mounted_vllm_cache():
    container = (REPO / "roles/vllm_ranks/tasks/container.yml").read_text()
    mounted = yaml.safe_load((REPO / "roles/vllm_ranks/vars/main.yml").read_text())["_vllm_ranks_mounted_dirs"]
    index = mounted.index("{{ _glm53_cache_dir }}/vllm")
    mount = re.search(r"_vllm_ranks_mounted_dirs\[%d\] ~ ':(/[^']+)'" % index, container)
    assert mount, "the rank container no longer mounts ~/.cache/glm53/vllm"
    assert ENV_COMMON["TORCHINDUCTOR_CACHE_DIR"].startswith(mount.group(1) + "/")
