# SPDX-License-Identifier: MIT
"""overlay_selfcheck: report parsing and judgement (tests/unit/plugins/modules runs the module)."""
from __future__ import annotations

import json
from typing import Any, Dict

import pytest

from ansible_collections.sparkops.glm53.plugins.module_utils import selfcheck as sc


def report(ok: bool = True, **check_oks: bool) -> Dict[str, Any]:
    checks = [{"name": n, "ok": v, "detail": "%s %s" % (n, "fine" if v else "broken")} for n, v in check_oks.items()]
    return {"ok": ok, "checks": checks, "versions": {"vllm": "0.32.0", "glm53_overlay": "0.1.0"}}


def test_docker_run_argv_adds_name_env_and_command() -> None:
    argv = sc.docker_run_argv("reg/engine:1", env={"B": "2", "A": "x=y"}, name="sc1")
    assert argv == ["docker", "run", "--rm", "--network", "none", "--entrypoint", "glm53-overlay",
                    "--name", "sc1", "-e", "A=x=y", "-e", "B=2", "reg/engine:1", "selfcheck"]
    assert sc.container_name_of(argv[2:]) == "sc1"


def test_docker_run_argv_keeps_callers_name() -> None:
    argv = sc.docker_run_argv("img", ["true"], ["--name=mine"])
    assert argv == ["docker", "run", "--name=mine", "--entrypoint", "true", "img"]
    assert sc.container_name_of(sc.docker_run_argv("img")[2:]).startswith("glm53-selfcheck-")


def test_masked_argv_hides_env_values() -> None:
    shown = sc.masked_argv(["docker", "run", "-e", "HF_TOKEN=hf_secret", "img"])
    assert shown == ["docker", "run", "-e", "HF_TOKEN=********", "img"]


def test_parse_report_plain_and_after_log_lines() -> None:
    plain = sc.parse_report(json.dumps(report(a=True)))
    assert plain.ok and plain.checks == [sc.Check("a", True, "a fine")] and plain.versions["vllm"] == "0.32.0"
    noisy = "INFO 11-30 plugin loaded {'x': 1}\nWARNING {\"not\": \"report\"}\n" + json.dumps(report(b=True), indent=2)
    parsed = sc.parse_report(noisy)
    assert [c.name for c in parsed.checks] == ["b"]


def test_parse_report_stringifies_structured_detail() -> None:
    data = {"ok": True, "checks": [{"name": "n", "ok": True, "detail": {"k": 1}}]}
    assert sc.parse_report(json.dumps(data)).checks[0].detail == '{"k": 1}'


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "no JSON object"),
        ("Traceback (most recent call last):\n  ImportError: vllm", "no JSON object"),
        ('{"checks": []}', "no 'ok'"),
        ('{"ok": "yes"}', "boolean"),
        ('{"ok": true, "checks": {}}', "must be a list"),
        ('{"ok": true, "checks": [{"ok": true}]}', "lacks 'name'"),
        ('{"ok": true, "versions": []}', "'versions'"),
    ],
)
def test_parse_report_rejects(text: str, needle: str) -> None:
    with pytest.raises(sc.SelfcheckError, match=needle):
        sc.parse_report(text)


def test_evaluate_pass() -> None:
    verdict = sc.evaluate(0, json.dumps(report(a=True, b=True)), "")
    assert verdict.ok and "2 checks" in verdict.msg


def test_evaluate_names_first_failing_check() -> None:
    verdict = sc.evaluate(1, json.dumps(report(False, a=True, nope_padding=False, dflash=False)), "")
    assert not verdict.ok and verdict.msg == "overlay selfcheck failed: nope_padding: nope_padding broken"
    assert verdict.report is not None


def test_evaluate_distrusts_inconsistent_reports() -> None:
    assert "a: a broken" in sc.evaluate(0, json.dumps(report(True, a=False)), "").msg
    assert "without a failing check" in sc.evaluate(1, json.dumps(report(False, a=True)), "").msg
    assert "exited 3" in sc.evaluate(3, json.dumps(report(True, a=True)), "segfault").msg


def test_evaluate_requires_must_run_checks_to_have_run() -> None:
    text = json.dumps(report(a=True, gpu=True) | {"checks": [
        {"name": "a", "ok": True, "detail": "fine"},
        {"name": "gpu", "ok": True, "detail": "skipped: no CUDA device visible", "skipped": True}]})
    assert sc.evaluate(0, text, "").ok
    verdict = sc.evaluate(0, text, "", must_run=["gpu"])
    assert not verdict.ok and verdict.msg == "overlay selfcheck skipped gpu, which must run here: skipped: no CUDA device visible"
    assert "has no check 'kernels'" in sc.evaluate(0, text, "", must_run=["kernels"]).msg
    assert verdict.report is not None and verdict.report.checks[1].as_dict()["skipped"] is True


def test_evaluate_unparsable_output_shows_stderr() -> None:
    verdict = sc.evaluate(125, "", "docker: Error response from daemon: pull access denied\n")
    assert not verdict.ok and verdict.report is None
    assert "exit 125" in verdict.msg and "pull access denied" in verdict.msg
