# SPDX-License-Identifier: MIT
"""The run_lock module as Ansible runs it: take, wait, fail naming the holder, release; check mode."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict

import pytest

ModuleRunner = Callable[..., Dict[str, Any]]
# This machine's boot: a holder that recorded it was taken since the last reboot.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()


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


# --------------------------------------------------------------------------- holders that are gone (issue 24)

def write_holder(path: Path, **holder: Any) -> None:
    path.mkdir(parents=True)
    (path / "holder.json").write_text(json.dumps(holder))


def fake_docker(tmp_path: Path, script: str) -> Dict[str, str]:
    """A `docker` first on PATH that answers `docker inspect` as the head's dockerd would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text("#!/bin/sh\necho \"$@\" >> %s\n%s\n" % (tmp_path / "docker-calls", script))
    docker.chmod(0o755)
    return {"PATH": "%s:%s" % (bin_dir, os.environ.get("PATH", ""))}


SUPERVISOR = {"token": "glm53-self-heal", "owner": "glm53 self-healing supervisor on spark1",
              "playbook": "self-healing recovery", "since": 1000.0, "container": "glm53-self-heal"}


def test_a_supervisor_removed_mid_recovery_is_broken_at_once(tmp_path: Path, run_module: ModuleRunner) -> None:
    path = tmp_path / "glm53" / "run.lock"
    write_holder(path, boot_id=BOOT_ID, **SUPERVISOR)
    env = fake_docker(tmp_path, "echo 'Error: No such object: glm53-self-heal' >&2; exit 1")
    probe = run_module("run_lock", {"path": str(path), "token": "run-b"}, check=True, env=env)
    assert probe["gone"] and probe["why"] == "its container glm53-self-heal no longer runs on the head (absent)"
    assert (path / "holder.json").exists()  # check mode breaks nothing
    took = run_module("run_lock", {"path": str(path), "token": "run-b", "timeout": 30}, env=env)
    # Broken at once, not after the 30 s timeout: the bound is half that, for a loaded machine.
    assert took["acquired"] and took["broken"] and took["waited_s"] < 15 and took["holder"]["token"] == "glm53-self-heal"
    assert "no longer runs on the head (absent)" in took["why"]
    assert "inspect -f {{.State.Status}} glm53-self-heal" in (tmp_path / "docker-calls").read_text()
    mine = json.loads((path / "holder.json").read_text())
    assert mine["token"] == "run-b" and mine["boot_id"] == BOOT_ID  # the new holder records this boot


def test_a_running_supervisor_is_waited_for(tmp_path: Path, run_module: ModuleRunner) -> None:
    path = tmp_path / "run.lock"
    write_holder(path, boot_id=BOOT_ID, **SUPERVISOR)
    env = fake_docker(tmp_path, "echo running")
    waited = run_module("run_lock", {"path": str(path), "token": "run-b", "timeout": 0.3, "poll_interval": 0.1},
                        env=env)
    assert waited["failed"] and not waited["broken"] and waited["waited_s"] >= 0.3
    assert "(its container glm53-self-heal is running on the head)" in waited["msg"]
    assert json.loads((path / "holder.json").read_text())["token"] == "glm53-self-heal"


def test_a_holder_from_before_the_last_reboot_is_broken(tmp_path: Path, run_module: ModuleRunner) -> None:
    path = tmp_path / "run.lock"
    write_holder(path, token="run-a", owner="bob@desk pid 7", controller="desk", pid=7, boot_id="an-earlier-boot")
    took = run_module("run_lock", {"path": str(path), "token": "run-b", "controller": "laptop", "timeout": 30})
    assert took["acquired"] and took["broken"]
    assert took["why"].startswith("the head rebooted since the lock was taken (boot id an-earli then")


def test_a_run_of_this_controller_is_judged_by_its_process(tmp_path: Path, run_module: ModuleRunner) -> None:
    path = tmp_path / "run.lock"
    write_holder(path, token="run-a", owner="alice@laptop pid 4242", controller="laptop", pid=4242,
                 boot_id=BOOT_ID)
    args = {"path": str(path), "token": "run-b", "controller": "laptop", "timeout": 0.2, "poll_interval": 0.1}
    alive = run_module("run_lock", dict(args, controller_pids=[4242, 4300]))
    assert alive["failed"] and "(a run of this controller (laptop) whose process 4242 still runs)" in alive["msg"]
    # break_dead=false: judged, but never broken.
    assert run_module("run_lock", dict(args, controller_pids=[4300], break_dead=False))["failed"]
    took = run_module("run_lock", dict(args, controller_pids=[4300]))
    assert took["acquired"] and took["why"] == "a run of this controller (laptop) whose process 4242 has exited"


def test_an_old_lock_without_the_new_records_is_still_waited_for(tmp_path: Path, run_module: ModuleRunner) -> None:
    path = tmp_path / "run.lock"
    write_holder(path, token="glm53-self-heal", owner="glm53 self-healing supervisor", since=1000.0)
    env = fake_docker(tmp_path, "echo 'Error: No such object: glm53-self-heal' >&2; exit 1")
    waited = run_module("run_lock", {"path": str(path), "token": "run-b", "timeout": 0.2, "poll_interval": 0.1},
                        env=env)
    assert waited["failed"] and not waited["broken"]
    assert not (tmp_path / "docker-calls").exists()  # no container recorded: docker is not asked


def test_a_lock_that_cannot_be_made_is_not_blamed_on_a_holder(tmp_path: Path, run_module: ModuleRunner) -> None:
    blocker = tmp_path / "glm53"
    blocker.write_text("a file where the cache folder should be")
    failed = run_module("run_lock", {"path": str(blocker / "run.lock"), "token": "run-a"})
    assert failed["failed"] and failed["lock_error"] and failed["held"] is False
    assert failed["msg"].startswith("cannot create the run lock %s" % (blocker / "run.lock"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere; test_run_lock.py covers the message")
def test_a_cache_folder_this_user_cannot_write_is_named_with_the_fix(tmp_path: Path, run_module: ModuleRunner) -> None:
    cache = tmp_path / "glm53"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        failed = run_module("run_lock", {"path": str(cache / "run.lock"), "token": "run-a"})
    finally:
        cache.chmod(0o755)
    assert failed["failed"] and failed["lock_error"] and "nobody" not in failed["msg"]
    assert "permission denied on %s (owned by uid %d" % (cache, os.geteuid()) in failed["msg"]
    assert "Fix: sudo chown -R " in failed["msg"] and failed["msg"].endswith(str(cache))
