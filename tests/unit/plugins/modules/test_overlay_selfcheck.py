# SPDX-License-Identifier: MIT
"""The overlay_selfcheck module as Ansible runs it, against a fake ``docker`` on PATH."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict

ModuleRunner = Callable[..., Dict[str, Any]]

FAKE_DOCKER = """#!{python}
# Test double for `docker run ... IMAGE CMD`: prints FAKE_SELFCHECK_OUT, exits FAKE_SELFCHECK_RC,
# and records its argv so the test can see what the module ran.
import json, os, sys
open(os.environ["FAKE_DOCKER_ARGV"], "a").write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["image", "inspect"]:
    sys.stdout.write(os.environ.get("FAKE_IMAGE_ID", "sha256:" + "0" * 64) + "\\n")
if sys.argv[1] == "run":
    sys.stdout.write(os.environ.get("FAKE_SELFCHECK_OUT", ""))
    sys.stderr.write(os.environ.get("FAKE_SELFCHECK_ERR", ""))
    sys.exit(int(os.environ.get("FAKE_SELFCHECK_RC", "0")))
"""


def report(ok: bool = True, **check_oks: bool) -> Dict[str, Any]:
    checks = [{"name": n, "ok": v, "detail": "%s %s" % (n, "fine" if v else "broken")} for n, v in check_oks.items()]
    return {"ok": ok, "checks": checks, "versions": {"vllm": "0.32.0", "glm53_overlay": "0.1.0"}}


def run_selfcheck(run_module: ModuleRunner, tmp_path: Path, args: Dict[str, Any], out: str, rc: int = 0,
                  err: str = "", image_id: str = "sha256:" + "a" * 64) -> Dict[str, Any]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "docker"
    script.write_text(FAKE_DOCKER.format(python=sys.executable))
    script.chmod(0o755)
    env = dict(PATH="%s%s%s" % (bin_dir, os.pathsep, os.environ["PATH"]), FAKE_SELFCHECK_OUT=out,
               FAKE_SELFCHECK_RC=str(rc), FAKE_SELFCHECK_ERR=err, FAKE_DOCKER_ARGV=str(tmp_path / "argv.jsonl"),
               FAKE_IMAGE_ID=image_id)
    return run_module("overlay_selfcheck", args, env=env)


def test_passes_and_returns_report(tmp_path: Path, run_module: ModuleRunner) -> None:
    result = run_selfcheck(run_module, tmp_path, {"image": "engine:cpu", "env": {"HF_TOKEN": "hf_x"}, "_ansible_check_mode": True},
                           "INFO loading plugin\n" + json.dumps(report(exl3=True)))
    assert not result.get("failed") and result["changed"] is False and result["ok"] is True
    assert result["checks"][0]["name"] == "exl3" and result["versions"]["glm53_overlay"] == "0.1.0"
    ran = json.loads((tmp_path / "argv.jsonl").read_text().splitlines()[0])
    assert ran[-2:] == ["engine:cpu", "selfcheck"] and "glm53-overlay" in ran and "HF_TOKEN=hf_x" in ran
    assert "hf_x" not in json.dumps(result)


def test_fails_naming_the_check(tmp_path: Path, run_module: ModuleRunner) -> None:
    result = run_selfcheck(run_module, tmp_path, {"image": "engine:cpu"}, json.dumps(report(False, exl3=True, ablation=False)), 1)
    assert result["failed"] is True and result["msg"] == "overlay selfcheck failed: ablation: ablation broken"
    assert result["ok"] is False and len(result["checks"]) == 2


def test_fails_on_non_json(tmp_path: Path, run_module: ModuleRunner) -> None:
    result = run_selfcheck(run_module, tmp_path, {"image": "engine:cpu"}, "", 127, "exec: glm53-overlay: not found")
    assert result["failed"] is True and "not found" in result["msg"] and "checks" not in result


def _docker_runs(tmp_path: Path) -> int:
    return sum(json.loads(line)[0] == "run" for line in (tmp_path / "argv.jsonl").read_text().splitlines())


def test_a_passed_image_is_not_checked_again_until_its_id_changes(tmp_path: Path, run_module: ModuleRunner) -> None:
    args = {"image": "engine:cpu", "record_dir": str(tmp_path / "records"), "env": {"HF_TOKEN": "hf_secret"}}
    passing = json.dumps(report(exl3=True))
    first = run_selfcheck(run_module, tmp_path, args, passing)
    assert not first.get("failed") and first["cached"] is False and Path(first["record"]).is_file()
    assert "hf_secret" not in Path(first["record"]).name + Path(first["record"]).read_text()
    # The image would now fail: a record for its unchanged ID answers instead, without a docker run.
    again = run_selfcheck(run_module, tmp_path, args, json.dumps(report(False, exl3=False)), 1)
    assert not again.get("failed") and again["cached"] is True and again["checks"] == first["checks"]
    assert _docker_runs(tmp_path) == 1
    rebuilt = run_selfcheck(run_module, tmp_path, args, json.dumps(report(False, exl3=False)), 1,
                            image_id="sha256:" + "b" * 64)
    assert rebuilt["failed"] is True and rebuilt["cached"] is False and _docker_runs(tmp_path) == 2


def test_a_record_is_per_way_of_running_and_never_written_for_a_failure_or_in_check_mode(
        tmp_path: Path, run_module: ModuleRunner) -> None:
    records = tmp_path / "records"
    base = {"image": "engine:cpu", "record_dir": str(records)}
    failed = run_selfcheck(run_module, tmp_path, base, json.dumps(report(False, exl3=False)), 1)
    assert failed["failed"] is True and not records.exists()
    checked = run_selfcheck(run_module, tmp_path, dict(base, _ansible_check_mode=True), json.dumps(report(exl3=True)))
    assert not checked.get("failed") and not records.exists()
    run_selfcheck(run_module, tmp_path, base, json.dumps(report(exl3=True)))
    # A GPU image's required checks are another way of running it: the CPU pass does not stand for it.
    gpu = run_selfcheck(run_module, tmp_path, dict(base, must_run=["exl3"]), json.dumps(report(exl3=True)))
    assert gpu["cached"] is False and _docker_runs(tmp_path) == 4 and len(list(records.iterdir())) == 2
