"""Every setting in the glm53 argument spec is shown in the example inventory and in README."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SPEC = yaml.safe_load((REPO / "roles/glm53/meta/argument_specs.yml").read_text())
SETTINGS = sorted(SPEC["argument_specs"]["main"]["options"])
EXAMPLE = (REPO / "inventory/example/group_vars/sparks/main.yml").read_text() + (
    REPO / "inventory/example/hosts.yml").read_text()
README = (REPO / "README.md").read_text()
DEFAULTS = yaml.safe_load((REPO / "roles/glm53/defaults/main.yml").read_text())


@pytest.mark.parametrize("name", SETTINGS)
def test_setting_in_example_inventory(name: str) -> None:
    assert f"{name}:" in EXAMPLE, f"{name} is not shown in inventory/example"


@pytest.mark.parametrize("name", SETTINGS)
def test_setting_in_readme(name: str) -> None:
    assert f"`{name}`" in README, f"{name} is not documented in README.md"


def test_every_default_has_a_spec() -> None:
    assert sorted(DEFAULTS) == sorted(n for n in SETTINGS if n in DEFAULTS)
    assert set(DEFAULTS) <= set(SETTINGS)
