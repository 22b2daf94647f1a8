# SPDX-License-Identifier: MIT
"""Replica groups as site.yml, stop.yml and the other playbooks take them (docs/replica-groups.md), in check mode
against two local inventory hosts: each group gets its own play after the supply, a bad layout and what replica
groups do not support are refused before any stage runs. (The deployment itself: molecule four_nodes.)"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Tuple

import pytest

REPO = Path(__file__).resolve().parents[3]
CheckRun = Callable[..., subprocess.CompletedProcess[str]]


def pair(head: str, worker: str) -> str:
    """The conftest's two local hosts, with these glm53_replica_group values ('' leaves it unset)."""
    def host(name: str, ip: str, group: str) -> str:
        return "        %s: {glm53_fabric_ip: %s%s}\n" % (name, ip, ", glm53_replica_group: %s" % group if group else "")
    return ("all:\n  children:\n    sparks:\n      hosts:\n" + host("spark-head", "10.0.0.1", head)
            + host("spark-worker", "10.0.0.2", worker)
            + "  vars:\n    ansible_connection: local\n    ansible_python_interpreter: %s\n" % sys.executable)


def play(check_run: CheckRun, playbook: str, inventory: str, *args: str) -> Tuple[int, str]:
    proc = check_run(REPO / playbook, *args, inventory=inventory, timeout=180)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "[WARNING]: Found duplicate" not in out, out
    return proc.returncode, out


def test_each_group_gets_its_own_play_after_the_supply(check_run: CheckRun) -> None:
    # A tag no task has: only what is tagged always runs (the layout, the settings, the guards, the lock).
    rc, out = play(check_run, "site.yml", pair("a", "b"), "--tags", "no_such_stage")
    assert rc == 0, out
    plays = re.findall(r"PLAY \[([^\]]+)\]", out)
    assert plays[:3] == ["Sort the Sparks into replica groups (glm53_replica_group)",
                         "Supply every replica group with the engine image and the weights",
                         "Deploy GLM-5.3 Flash across the Sparks"], plays
    # The one-group play matched no host; each replica group's play ran on its own host.
    assert re.search(r"PLAY \[Deploy GLM-5.3 Flash across the Sparks\] \*+ skipping: no hosts matched", out), out
    for index, host in ((1, "spark-head"), (2, "spark-worker")):
        section = out.split("PLAY [Deploy GLM-5.3 Flash across the Sparks, replica group %d]" % index)[1]
        section = section.split("PLAY [")[0]
        assert "TASK [sparkops.glm53.glm53 : Check that replica groups are deployed by their own plays]" in section
        assert "[%s]" % host in section and "[%s]" % ({"spark-head", "spark-worker"} - {host}).pop() not in section


def test_a_layout_with_a_spark_left_out_is_refused_before_any_stage(check_run: CheckRun) -> None:
    rc, out = play(check_run, "site.yml", pair("a", ""))
    assert rc == 2, out
    assert ("glm53_replica_group is set on spark-head but not on spark-worker: give every Spark a replica group, "
            "or none") in out, out
    assert "PLAY [Supply every replica group" not in out and "Take the run lock" not in out, out


def test_glm53_group_from_the_command_line_is_refused(check_run: CheckRun) -> None:
    rc, out = play(check_run, "site.yml", pair("a", "b"), "-e", "glm53_group=sparks")
    assert rc == 2, out
    assert ("glm53_group (sparks) cannot be given on the command line with replica groups: site.yml sets it in the "
            "play of each group. Leave -e glm53_group out.") in out, out
    assert "Take the run lock" not in out, out


def test_a_playbook_that_takes_the_sparks_as_one_group_refuses_replica_groups(check_run: CheckRun) -> None:
    rc, out = play(check_run, "playbooks/fabric_check.yml", pair("a", "b"))
    assert rc == 2, out
    assert ("the Sparks of sparks are in replica groups (glm53_replica_group), and this playbook takes them as one "
            "group; it does not handle replica groups yet (docs/replica-groups.md). Nothing was changed.") in out, out


@pytest.mark.parametrize(("node", "shown"), [
    ("head", [("1", "spark-head"), ("2", "spark-worker")]),
    ("spark-worker", [("2", "spark-worker")]),
])
def test_logs_reads_the_chosen_rank_of_each_group(
        check_run: CheckRun, node: str, shown: list[tuple[str, str]]) -> None:
    # No rank container runs on this machine: each chosen rank's read ends in docker's "No such container".
    rc, out = play(check_run, "playbooks/logs.yml", pair("a", "b"), "-e", "logs_node=" + node)
    assert rc == 0, out
    printed = [(group, host) for section in re.split(r"PLAY \[", out)[1:]
               for group in re.findall(r"^Show the engine log of one rank, replica group (\d)\]", section)
               for host in re.findall(r"ok: \[([\w-]+)\] => msg: '?no log: ", section)]
    assert printed == shown, out


@pytest.mark.parametrize(("groups", "extra", "message"), [
    (("a", "b"), ["-e", "glm53_edge=true"],
     "glm53_edge: in front of replica groups the edge fronts vLLM's router; turn glm53_router on too "
     "(docs/replica-groups.md), or the edge off. Nothing was changed."),
    (("", ""), ["-e", "glm53_router=true"],
     "glm53_router: vLLM's router fronts replica groups (glm53_replica_group on every Spark); one group has "
     "one API, its head's."),
    (("a", "b"), ["-e", "glm53_router=true", "-e", "glm53_router_host=gateway"],
     "glm53_router_host (gateway) must be one of the Sparks (spark-head, spark-worker): the router runs from "
     "the engine image they hold."),
], ids=["edge-without-router", "router-without-groups", "router-host-not-a-spark"])
def test_a_front_that_cannot_work_is_refused_before_the_lock(
        check_run: CheckRun, groups: tuple[str, str], extra: list[str], message: str) -> None:
    rc, out = play(check_run, "site.yml", pair(*groups), *extra)
    assert rc == 2, out
    assert message in out, out
    assert "Take the run lock" not in out, out


def test_the_router_and_the_edge_get_a_play_after_every_group(check_run: CheckRun) -> None:
    rc, out = play(check_run, "site.yml", pair("a", "b"), "--tags", "no_such_stage",
                   "-e", "glm53_router=true", "-e", "glm53_edge=true",
                   "-e", '{"glm53_edge_keys": {"alice": "alice-key-0123456789"}}')
    assert rc == 0, out
    plays = re.findall(r"PLAY \[([^\]]+)\]", out)
    assert plays[-1] == "One endpoint in front of the replica groups", plays
    assert plays.index("Deploy GLM-5.3 Flash across the Sparks, replica group 2") < len(plays) - 1, plays
