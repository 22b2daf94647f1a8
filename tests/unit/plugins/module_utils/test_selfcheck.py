# SPDX-License-Identifier: MIT
"""overlay_selfcheck: report parsing and judgement, and the module against a fake ``docker`` on PATH."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from ansible_collections.sparkops.glm53.plugins.module_utils import selfcheck as sc

REPO = Path(__file__).resolve().parents[4]


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


# --------------------------------------------------------------------------- module, fake docker

FAKE_DOCKER = """#!{python}
# Test double for `docker run ... IMAGE CMD`: prints FAKE_SELFCHECK_OUT, exits FAKE_SELFCHECK_RC,
# and records its argv so the test can see what the module ran.
import json, os, sys
open(os.environ["FAKE_DOCKER_ARGV"], "a").write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "run":
    sys.stdout.write(os.environ.get("FAKE_SELFCHECK_OUT", ""))
    sys.stderr.write(os.environ.get("FAKE_SELFCHECK_ERR", ""))
    sys.exit(int(os.environ.get("FAKE_SELFCHECK_RC", "0")))
"""


def run_selfcheck(tmp_path: Path, args: Dict[str, Any], out: str, rc: int = 0, err: str = "") -> Dict[str, Any]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "docker"
    script.write_text(FAKE_DOCKER.format(python=sys.executable))
    script.chmod(0o755)
    env = dict(os.environ, PATH="%s%s%s" % (bin_dir, os.pathsep, os.environ["PATH"]),
               PYTHONPATH=str(REPO / ".collections"), FAKE_SELFCHECK_OUT=out, FAKE_SELFCHECK_RC=str(rc),
               FAKE_SELFCHECK_ERR=err, FAKE_DOCKER_ARGV=str(tmp_path / "argv.jsonl"))
    proc = subprocess.run([sys.executable, str(REPO / "plugins" / "modules" / "overlay_selfcheck.py")],
                          input=json.dumps({"ANSIBLE_MODULE_ARGS": args}).encode(), capture_output=True,
                          env=env, timeout=60, check=False)
    assert proc.stdout, proc.stderr.decode()
    return json.loads(proc.stdout)


def test_module_passes_and_returns_report(tmp_path: Path) -> None:
    result = run_selfcheck(tmp_path, {"image": "engine:cpu", "env": {"HF_TOKEN": "hf_x"}, "_ansible_check_mode": True},
                           "INFO loading plugin\n" + json.dumps(report(exl3=True)))
    assert not result.get("failed") and result["changed"] is False and result["ok"] is True
    assert result["checks"][0]["name"] == "exl3" and result["versions"]["glm53_overlay"] == "0.1.0"
    ran = json.loads((tmp_path / "argv.jsonl").read_text().splitlines()[0])
    assert ran[-2:] == ["engine:cpu", "selfcheck"] and "glm53-overlay" in ran and "HF_TOKEN=hf_x" in ran
    assert "hf_x" not in json.dumps(result)


def test_module_fails_naming_the_check(tmp_path: Path) -> None:
    result = run_selfcheck(tmp_path, {"image": "engine:cpu"}, json.dumps(report(False, exl3=True, ablation=False)), 1)
    assert result["failed"] is True and result["msg"] == "overlay selfcheck failed: ablation: ablation broken"
    assert result["ok"] is False and len(result["checks"]) == 2


def test_module_fails_on_non_json(tmp_path: Path) -> None:
    result = run_selfcheck(tmp_path, {"image": "engine:cpu"}, "", 127, "exec: glm53-overlay: not found")
    assert result["failed"] is True and "not found" in result["msg"] and "checks" not in result
