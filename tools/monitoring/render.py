"""Render the monitoring role's Prometheus config and rule templates outside Ansible, for promtool.

    python -m tools.monitoring.render build/monitoring [--set glm53_monitoring_down_for=15s ...]

Values are the defaults of roles/glm53/meta/argument_specs.yml (the same ones the role renders with), the
cluster an example of two nodes. The templates use plain Jinja only, so this output equals the role's.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jinja2
import yaml

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "roles/glm53/meta/argument_specs.yml"
TEMPLATES = REPO / "roles/monitoring/templates"
# Stand-ins for the facts the role derives from the inventory.
EXAMPLE_CLUSTER: dict[str, Any] = {
    "_monitoring_cluster_name": "glm53",
    "_monitoring_vllm_target": "10.0.0.1:8888",
    # [node, rank, address] per node, as the role's vars/main.yml builds them.
    "_monitoring_targets": [["spark-head", 0, "10.0.0.1"], ["spark-worker", 1, "10.0.0.2"]],
    # The first replica group's stack behind vLLM's router: it also scrapes the router and every group.
    "_monitoring_front": True,
}


def monitoring_defaults(spec_path: Path = SPEC) -> dict[str, Any]:
    options = yaml.safe_load(spec_path.read_text())["argument_specs"]["main"]["options"]
    return {name: spec["default"] for name, spec in options.items()
            if name.startswith("glm53_monitoring") and "default" in spec}


def render_all(values: dict[str, Any]) -> dict[str, str]:
    """Relative output path -> text, for prometheus.yml and every rules/*.yml.j2."""
    # trim_blocks as Ansible's template module sets it, so both write the same bytes.
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True)
    names = ["prometheus.yml.j2"] + sorted(f"rules/{p.name}" for p in (TEMPLATES / "rules").glob("*.yml.j2"))
    return {name.removesuffix(".j2"): env.get_template(name).render(values) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a setting (value parsed as YAML)")
    args = parser.parse_args(argv)
    values = {**monitoring_defaults(), **EXAMPLE_CLUSTER}
    for item in args.set:
        name, sep, raw = item.partition("=")
        if not sep or name not in values:
            parser.error(f"--set {item!r}: expected NAME=VALUE with NAME one of the glm53_monitoring_* settings")
        values[name] = yaml.safe_load(raw)
    for rel, text in render_all(values).items():
        path = args.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
