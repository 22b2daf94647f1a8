"""The settings' copies (defaults, example inventory, docs) are exactly what the generator writes from the spec."""
from __future__ import annotations

from pathlib import Path

import yaml

from tools import generate_settings as gen


def test_generated_files_are_in_sync_with_the_spec() -> None:
    stale = [str(p.relative_to(gen.REPO)) for p, text in gen.rendered().items() if p.read_text() != text]
    assert not stale, f"run `make settings`: {stale} differ from roles/glm53/meta/argument_specs.yml"


def test_a_setting_added_to_the_spec_reaches_every_copy(tmp_path: Path) -> None:
    spec_text = gen.SPEC.read_text().replace(
        "      # -- Load-time ablation\n",
        "      # -- Load-time ablation\n"
        "      glm53_new_knob:\n        type: int\n        default: 7\n        description: A new C(knob).\n")
    spec = tmp_path / "argument_specs.yml"
    spec.write_text(spec_text)
    files = gen.rendered(spec)
    assert yaml.safe_load(files[gen.DEFAULTS])["glm53_new_knob"] == 7
    assert "# A new knob.\n# glm53_new_knob: 7\n" in files[gen.EXAMPLE]
    assert "| `glm53_new_knob` | int | `7` | A new `knob`. |" in files[gen.DOCS]


def test_per_host_settings_are_never_defaulted_and_are_shown_in_the_hosts_file() -> None:
    settings = gen.load_settings()
    per_host = [s.name for s in settings if s.per_host]
    defaults = yaml.safe_load(gen.DEFAULTS.read_text())
    hosts = (gen.REPO / "inventory/example/hosts.yml").read_text()
    assert per_host and not set(per_host) & set(defaults)
    assert all(f"{name}:" in hosts for name in per_host)


def test_secrets_are_shown_as_vault_references() -> None:
    example = gen.EXAMPLE.read_text()
    for s in gen.load_settings():
        if s.secret:
            assert f'# {s.name}: "{{{{ vault_{s.name} }}}}"' in example
