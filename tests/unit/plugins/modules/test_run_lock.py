# SPDX-License-Identifier: MIT
"""The run_lock module as Ansible runs it: take, wait, fail naming the holder, release; check mode."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict

ModuleRunner = Callable[..., Dict[str, Any]]


def test_take_wait_fail_release(tmp_path: Path, run_module: ModuleRunner) -> None:
    path = str(tmp_path / "glm53" / "run.lock")
    first = run_module("run_lock", {"path": path, "token": "run-a", "owner": "alice@laptop pid 4242", "playbook": "site.yml"})
    assert first["acquired"] and not first["held"] and first["changed"] is False
    probe = run_module("run_lock", {"path": path, "token": "run-b"}, check=True)
    assert probe["acquired"] is False and probe["held"] and probe["holder"]["owner"] == "alice@laptop pid 4242"
    waited = run_module("run_lock", {"path": path, "token": "run-b", "timeout": 0.3, "poll_interval": 0.1})
    assert waited["failed"] and "held by alice@laptop pid 4242 running site.yml" in waited["msg"]
    assert waited["waited_s"] >= 0.3 and waited["holder"]["token"] == "run-a"
    assert run_module("run_lock", {"path": path, "token": "run-b", "state": "absent"})["release"] == "not ours"
    assert run_module("run_lock", {"path": path, "token": "run-a", "state": "absent"}, check=True)["release"] == "released"
    assert os.path.isdir(path)
    released = run_module("run_lock", {"path": path, "token": "run-a", "state": "absent"})
    assert released["release"] == "released" and released["changed"] is False and not os.path.exists(path)


def test_check_mode_never_creates_the_lock(tmp_path: Path, run_module: ModuleRunner) -> None:
    path = tmp_path / "run.lock"
    result = run_module("run_lock", {"path": str(path), "token": "run-a"}, check=True)
    assert result["acquired"] and not path.exists()
