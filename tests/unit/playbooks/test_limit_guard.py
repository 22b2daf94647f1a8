# SPDX-License-Identifier: MIT
"""--limit on the playbooks that act on the whole group (roles/preflight/tasks/limit.yml): site.yml, stop.yml and
fabric_check.yml refuse a --limit that leaves out a Spark, before anything changes, in check mode too; a
--limit that names every Spark passes. Runs the real playbooks with ansible-playbook against two inventory
hosts that are both this machine (connection local), always in check mode, so a broken guard changes nothing."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Callable, Tuple

import pytest

REPO = Path(__file__).resolve().parents[3]
# The conftest.py fixture check_run: one `ansible-playbook --check` against two local inventory hosts.
CheckRun = Callable[..., subprocess.CompletedProcess[str]]
# What each playbook tells the user to do instead.
PLAYBOOKS = {
    "site.yml": "Run site.yml without --limit",
    "playbooks/stop.yml": "A group stops as a whole: run playbooks/stop.yml without --limit",
    "playbooks/fabric_check.yml": ("The check measures every node against every other: run playbooks/fabric_check.yml "
                                   "without --limit (it changes nothing)"),
}


def play(check_run: CheckRun, playbook: str, *args: str) -> Tuple[int, str]:
    """(exit code, output with line folding undone) of one check-mode run."""
    proc = check_run(REPO / playbook, *args, timeout=120)
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())


@pytest.mark.parametrize("playbook", sorted(PLAYBOOKS))
def test_a_limit_leaving_out_a_spark_is_refused_before_anything_runs(check_run: CheckRun, playbook: str) -> None:
    rc, out = play(check_run, playbook, "--limit", "spark-worker")
    assert rc == 2, out
    assert ("--limit spark-worker leaves out spark-head of the group sparks (glm53_group), and its ranks form one "
            "tensor-parallel group that runs only as a whole. Nothing was changed. " + PLAYBOOKS[playbook]) in out, out
    # The guard is the last task that ran: no stage, lock or stop came after it.
    tasks = re.findall(r"TASK \[([^\]]+)\]", out)
    assert tasks[-1] == "sparkops.glm53.preflight : Refuse a --limit that leaves out some of the group's hosts", tasks
    assert re.search(r"spark-worker : ok=\d+ changed=0 unreachable=0 failed=1", out), out


def test_tags_do_not_get_past_the_guard(check_run: CheckRun) -> None:
    rc, out = play(check_run, "site.yml", "--limit", "spark-worker", "--tags", "health")
    assert rc == 2 and "--limit spark-worker leaves out spark-head" in out, out


@pytest.mark.parametrize("playbook,limit", [("site.yml", "spark-head,spark-worker"), ("playbooks/stop.yml", "sparks")])
def test_a_limit_naming_every_spark_passes(check_run: CheckRun, playbook: str, limit: str) -> None:
    # A tag no task has: only the settings and the guard (both tagged always) run.
    rc, out = play(check_run, playbook, "--limit", limit, "--tags", "no_such_stage")
    assert rc == 0, out
    assert out.count("TASK [sparkops.glm53.preflight : Refuse a --limit that leaves out some of the group's hosts]") == 1
    assert re.search(r"spark-head : ok=\d+ changed=0 unreachable=0 failed=0", out), out
    assert re.search(r"spark-worker : ok=\d+ changed=0 unreachable=0 failed=0", out), out
