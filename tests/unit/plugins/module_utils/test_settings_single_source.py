# SPDX-License-Identifier: MIT
"""Each fact about a setting has one home: its type, default and choices the argument spec, its range or format
settings_rules.RULES. The few copies code cannot avoid (module_utils read no files, the overlay runs in the
engine container, the supervisor on the head's plain python3) are proven equal to the spec here, so a value
edited in one place alone fails."""
from __future__ import annotations

import ast
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import jinja2
import yaml
from ansible_collections.sparkops.glm53.plugins.module_utils import self_heal, serve_argv
from ansible_collections.sparkops.glm53.plugins.module_utils.settings_rules import RULES, settings_errors
from ansible_collections.sparkops.glm53.plugins.plugin_utils.argument_spec import spec_options

REPO = Path(__file__).resolve().parents[4]
SPEC = spec_options()
DEFAULTS = {name: entry["default"] for name, entry in SPEC.items() if "default" in entry}


def test_every_rule_names_a_setting_of_the_spec() -> None:
    assert set(RULES) <= set(SPEC)


def test_every_spec_default_passes_its_type_choices_and_rule() -> None:
    assert settings_errors(DEFAULTS, SPEC) == []


def _functions_validate_settings_runs() -> list[ast.FunctionDef]:
    tree = ast.parse(Path(serve_argv.__file__).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    found: dict[str, ast.FunctionDef] = {}
    todo = ["validate_settings"]
    while todo:
        name = todo.pop()
        if name in functions and name not in found:
            found[name] = functions[name]
            todo += [node.func.id for node in ast.walk(functions[name])
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    return list(found.values())


def _is_number(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def test_the_rules_between_serve_settings_hold_no_range_of_one_setting() -> None:
    # A range is an ordering against a number (`v >= 1`, `0 < v <= 1`): RULES holds every one of them.
    ranges = [f"serve_argv.py:{node.lineno} in {function.name}: {ast.unparse(node)}"
              for function in _functions_validate_settings_runs() for node in ast.walk(function)
              if isinstance(node, ast.Compare)
              and any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in node.ops)
              and any(_is_number(side) for side in (node.left, *node.comparators))]
    assert not ranges, f"move these to settings_rules.RULES: {ranges}"


def test_the_renderer_knows_every_speculative_method_the_spec_offers() -> None:
    for method in SPEC["glm53_spec_method"]["choices"]:
        config = serve_argv.speculative_config({"spec_method": method, "draft_model": "/draft",
                                                "dflash_tokens": 7, "mtp_tokens": 2})
        assert (config is None) == (method == "none"), method


def test_the_kv_dtypes_the_gpu_warning_accepts_are_spec_choices() -> None:
    assert set(serve_argv._GPU_KV_CACHE_DTYPES) <= set(SPEC["glm53_kv_cache_dtype"]["choices"])


def test_the_utilization_a_kv_size_must_leave_alone_is_the_spec_default() -> None:
    assert serve_argv.DEFAULT_GPU_MEMORY_UTILIZATION == DEFAULTS["glm53_gpu_memory_utilization"]
    # The renderer reads 0 as "no KV size": the default must leave the cache to the utilization.
    assert DEFAULTS["glm53_kv_cache_memory_bytes"] == 0


def _constants(path: Path) -> dict[str, Any]:
    """A module's top-level literal constants, read without importing it (the overlay needs torch)."""
    constants = {}
    for node in ast.parse(path.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
            try:
                constants[target.id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return constants


def test_the_overlays_ablation_choices_and_defaults_are_the_specs() -> None:
    # The engine container reads GLM53_ABLATION_* and has no argument spec to look at.
    overlay = _constants(REPO / "overlay/src/glm53_overlay/ablation/settings.py")
    assert list(overlay["METHODS"]) == SPEC["glm53_ablation_method"]["choices"]
    assert overlay["DEFAULT_LAYERS"] == DEFAULTS["glm53_ablation_layers"]
    assert overlay["DEFAULT_ALPHA"] == DEFAULTS["glm53_ablation_alpha"]


def _render_with_defaults(template: str) -> str:
    """A role's template as Ansible renders it with every setting at its spec default."""
    context = {**DEFAULTS,
               **yaml.safe_load((REPO / "roles/glm53/vars/main.yml").read_text()),
               **yaml.safe_load((REPO / "roles/self_heal/vars/main.yml").read_text())}
    return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(template).render(context)


def _tasks(tasks: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every task of a task file, those inside blocks included."""
    for task in tasks:
        yield task
        for part in ("block", "rescue", "always"):
            yield from _tasks(task.get(part, []))


def _task(path: str, name: str) -> dict[str, Any]:
    [task] = [t for t in _tasks(yaml.safe_load((REPO / path).read_text())) if t.get("name") == name]
    return task


def test_the_supervisors_defaults_are_what_install_yml_writes_from_the_spec() -> None:
    written = _task("roles/self_heal/tasks/install.yml", "Write the supervisor's configuration")["vars"][
        "_self_heal_settings"]
    policy = {name: _render_with_defaults(template) for name, template in written["policy"].items()}
    assert set(policy) == set(asdict(self_heal.Policy()))
    assert self_heal.Policy.from_dict(policy) == self_heal.Policy()
    assert int(_render_with_defaults(written["log_tail"])) == self_heal.SupervisorConfig.log_tail


def test_a_failed_launch_and_a_recovery_tear_down_with_the_same_grace() -> None:
    stop = _task("roles/health/tasks/failed.yml", "Stop every rank after a failed launch")
    assert int(_render_with_defaults(stop["community.docker.docker_container"]["stop_timeout"])) == \
        self_heal.Policy().teardown_s


def test_the_lock_token_the_supervisor_takes_is_the_one_stop_yml_releases() -> None:
    written = _task("roles/self_heal/tasks/install.yml", "Write the supervisor's configuration")["vars"][
        "_self_heal_settings"]
    release = _task("roles/self_heal/tasks/remove_container.yml", "Release a run lock the supervisor left behind")
    assert _render_with_defaults(written["lock_token"]) == \
        _render_with_defaults(release["sparkops.glm53.run_lock"]["token"]) != ""
