# SPDX-License-Identifier: MIT
"""molecule/faults, --limit (issue 24): site.yml, stop.yml and fabric_check.yml act on the whole tensor-parallel
group, so a --limit that leaves out a Spark is refused right after the settings load, before the run lock or any
stage (roles/preflight/tasks/limit.yml). Each refused run ends in seconds, names the host left out and what to
run instead, changes nothing (PLAY RECAP changed=0) and leaves the rank containers as they were (same ID and
start time). A --limit naming every Spark runs as usual. Preflight's RemoveIPC check says "not applicable" on
the simulated Sparks, which have no systemd-logind.

No engine starts here: while no group is serving, stand-in containers (a sleeping python3 from the engine
image) take the ranks' names, and are removed afterwards."""
from __future__ import annotations

import re
from typing import Iterator, List, Optional, Tuple

import pytest

from conftest import NAMES, RANK, SIM_VARS, USER, Run, Sim, recap

HEAD, WORKER = NAMES[0], NAMES[1]
# A refusal comes right after fact gathering and the settings; fabric_check.yml used to hang 600 s instead.
REFUSED_WITHIN_S = 90
Stamp = Optional[Tuple[str, str, bool]]


def stamps(sim: Sim) -> List[Stamp]:
    """Per rank: container ID, start time and whether it runs (None: no container). A stop or restart changes it."""
    out: List[Stamp] = []
    for rank in range(len(NAMES)):
        info = sim.container(rank)
        out.append((info["Id"], info["State"]["StartedAt"], bool(info["State"]["Running"])) if info else None)
    return out


@pytest.fixture(scope="module")
def ranks(sim: Sim) -> Iterator[None]:
    """Every rank name held by a running container: the real ranks if they serve, stand-ins otherwise."""
    made = []
    for rank in range(len(NAMES)):
        if sim.running(rank):
            continue
        sim.node(rank, "docker", "rm", "-f", RANK.format(rank))
        sim.node(rank, "docker", "run", "-d", "--name", RANK.format(rank), "--entrypoint", "python3",
                 SIM_VARS["glm53_image"], "-c", "import time; time.sleep(3600)", check=True)
        made.append(rank)
    assert all(sim.running(rank) for rank in range(len(NAMES))), stamps(sim)
    yield
    for rank in made:
        sim.node(rank, "docker", "rm", "-f", RANK.format(rank))


def refused(sim: Sim, name: str, playbook: str, *args: str) -> str:
    """Run `playbook` limited to the worker; assert it was refused fast, naming the head, with nothing changed.
    Returns the output on one line."""
    before, lock = stamps(sim), sim.lock_holder()
    run = sim.start(name, playbook, "--limit", WORKER, *args).wait(300)
    out = " ".join(run.output.split())
    assert run.rc != 0, run.evidence()
    assert ("--limit %s leaves out %s of the group sparks (glm53_group), and its ranks form one tensor-parallel "
            "group that runs only as a whole. Nothing was changed." % (WORKER, HEAD)) in out, run.evidence()
    assert run.seconds <= REFUSED_WITHIN_S, run.evidence()
    counts = recap(run.output)
    assert HEAD not in counts, run.evidence()
    assert counts[WORKER]["changed"] == 0 and counts[WORKER]["failed"] == 1, run.evidence()
    assert_guard_was_last(run)
    assert stamps(sim) == before, "the refused run touched a rank:\n%s" % run.evidence()
    assert sim.lock_holder() == lock, "the refused run touched the run lock:\n%s" % run.evidence()
    print("%s: refused after %ss" % (name, run.seconds))
    return out


def assert_guard_was_last(run: Run) -> None:
    tasks = re.findall(r"^TASK \[(.+?)\] \*", run.output, re.MULTILINE)
    assert tasks and tasks[-1] == "sparkops.glm53.preflight : Refuse a --limit that leaves out some of the group's hosts", \
        (tasks, run.tail())


def test_stop_limited_to_the_worker_is_refused_and_stops_nothing(sim: Sim, ranks: None) -> None:
    out = refused(sim, "limit-stop", "playbooks/stop.yml")
    assert "A group stops as a whole: run playbooks/stop.yml without --limit" in out


def test_fabric_check_limited_to_the_worker_is_refused_instead_of_hanging(sim: Sim, ranks: None) -> None:
    out = refused(sim, "limit-fabric-check", "playbooks/fabric_check.yml")
    assert "run playbooks/fabric_check.yml without --limit (it changes nothing)" in out


@pytest.mark.parametrize("mode", [[], ["--check"]], ids=["run", "check-mode"])
def test_site_limited_to_the_worker_is_refused_before_the_lock(sim: Sim, ranks: None, mode: List[str]) -> None:
    out = refused(sim, "limit-site" + "".join(mode), "site.yml", *mode)
    assert "Run site.yml without --limit" in out


def test_a_limit_naming_every_spark_runs_the_fabric_check(sim: Sim, ranks: None) -> None:
    run = sim.start("limit-fabric-check-all", "playbooks/fabric_check.yml", "--limit", ",".join(NAMES)).wait(300)
    assert run.rc == 0, run.evidence()
    assert "fabric check: no problem on %d node(s)" % len(NAMES) in " ".join(run.output.split()), run.evidence()


def test_preflight_says_removeipc_is_not_applicable_without_logind(sim: Sim, ranks: None) -> None:
    before = stamps(sim)
    run = sim.site("limit-preflight-logind", "--tags", "preflight", timeout=300)
    out = " ".join(run.output.split())
    assert run.rc == 0, run.evidence()
    for name in NAMES:
        assert ("RemoveIPC for %s on %s: not applicable (not booted with systemd, so no systemd-logind)"
                % (USER, name)) in out, run.evidence()
    assert "RemoveIPC: systemd-logind on" not in out, run.evidence()
    assert stamps(sim) == before, run.evidence()
