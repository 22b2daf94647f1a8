# SPDX-License-Identifier: MIT
"""--limit on the playbooks that act on the whole group (roles/preflight/tasks/limit.yml): site.yml, stop.yml and
fabric_check.yml refuse a --limit that leaves out a Spark, before anything changes, in check mode too; a
--limit that names every Spark passes. Runs the real playbooks with ansible-playbook against two inventory
hosts that are both this machine (connection local), always in check mode, so a broken guard changes nothing."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Tuple

import pytest

REPO = Path(__file__).resolve().parents[3]
INVENTORY = """\
all:
  children:
    sparks:
      hosts:
        spark-head: {glm53_fabric_ip: 10.0.0.1}
        spark-worker: {glm53_fabric_ip: 10.0.0.2}
  vars:
    ansible_connection: local
    ansible_python_interpreter: %s
""" % sys.executable
# What each playbook tells the user to do instead.
PLAYBOOKS = {
    "site.yml": "Run site.yml without --limit",
    "playbooks/stop.yml": "A group stops as a whole: run playbooks/stop.yml without --limit",
    "playbooks/fabric_check.yml": ("The check measures every node against every other: run playbooks/fabric_check.yml "
                                   "without --limit (it changes nothing)"),
}


def play(tmp_path: Path, playbook: str, *args: str) -> Tuple[int, str]:
    """(exit code, output with line folding undone) of one check-mode run."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(INVENTORY)
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_COLLECTIONS_PATH=str(REPO / ".collections"),
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "local"), ANSIBLE_REMOTE_TMP=str(tmp_path / "remote"),
               ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), "--check",
                           str(REPO / playbook), *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120, check=False)
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())


@pytest.mark.parametrize("playbook", sorted(PLAYBOOKS))
def test_a_limit_leaving_out_a_spark_is_refused_before_anything_runs(tmp_path: Path, playbook: str) -> None:
    rc, out = play(tmp_path, playbook, "--limit", "spark-worker")
    assert rc == 2, out
    assert ("--limit spark-worker leaves out spark-head of the group sparks (glm53_group), and its ranks form one "
            "tensor-parallel group that runs only as a whole. Nothing was changed. " + PLAYBOOKS[playbook]) in out, out
    # The guard is the last task that ran: no stage, lock or stop came after it.
    tasks = re.findall(r"TASK \[([^\]]+)\]", out)
    assert tasks[-1] == "sparkops.glm53.preflight : Refuse a --limit that leaves out some of the group's hosts", tasks
    assert re.search(r"spark-worker : ok=\d+ changed=0 unreachable=0 failed=1", out), out


def test_tags_do_not_get_past_the_guard(tmp_path: Path) -> None:
    rc, out = play(tmp_path, "site.yml", "--limit", "spark-worker", "--tags", "health")
    assert rc == 2 and "--limit spark-worker leaves out spark-head" in out, out


@pytest.mark.parametrize("playbook,limit", [("site.yml", "spark-head,spark-worker"), ("playbooks/stop.yml", "sparks")])
def test_a_limit_naming_every_spark_passes(tmp_path: Path, playbook: str, limit: str) -> None:
    # A tag no task has: only the settings and the guard (both tagged always) run.
    rc, out = play(tmp_path, playbook, "--limit", limit, "--tags", "no_such_stage")
    assert rc == 0, out
    assert out.count("TASK [sparkops.glm53.preflight : Refuse a --limit that leaves out some of the group's hosts]") == 1
    assert re.search(r"spark-head : ok=\d+ changed=0 unreachable=0 failed=0", out), out
    assert re.search(r"spark-worker : ok=\d+ changed=0 unreachable=0 failed=0", out), out
