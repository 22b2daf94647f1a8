# SPDX-License-Identifier: MIT
"""playbooks/fabric_check.yml on the simulated Sparks: MTU, rail state and full-MTU pings run for real over
the simulated fabric (the node containers' eth0 on the docker network), the NCCL step reports `skipped`
(no GPUs), and a broken MTU on one node is reported with the node and interface named. Needs only the node
containers, not the engine, so it costs seconds."""
from __future__ import annotations

import re

from conftest import HOSTS, NAMES, Sim

HEAD, WORKER = NAMES[0], NAMES[1]
HEAD_IP, WORKER_IP = HOSTS[HEAD]["glm53_fabric_ip"], HOSTS[WORKER]["glm53_fabric_ip"]
PLAYBOOK = "playbooks/fabric_check.yml"


def flat(text: str) -> str:
    """The run's output with YAML's line folding undone, so a long message matches in one piece."""
    return " ".join(text.split())


def mtu(sim: Sim, rank: int) -> int:
    return int(sim.node(rank, "cat", "/sys/class/net/eth0/mtu", check=True).stdout)


def test_fabric_check_reports_every_node_and_rail_and_skips_nccl_without_gpus(sim: Sim) -> None:
    run = sim.start("fabric-check", PLAYBOOK, "--tags", "fabric_check").wait(300)
    out = flat(run.output)
    assert run.rc == 0, run.evidence()
    usual = mtu(sim, 0)
    for name, ip in ((HEAD, HEAD_IP), (WORKER, WORKER_IP)):
        line = rf"{name} eth0 {re.escape(ip)}/24: up, mtu {usual}, [^,]+, ping 1/1 peers at full MTU"
        assert re.search(line, out), run.evidence()
    assert "NCCL all_reduce bus bandwidth: skipped (glm53_gpu is false" in out, run.evidence()
    assert "fabric check: no problem on 2 node(s)" in out, run.evidence()
    print(f"fabric_check.yml on a healthy simulated fabric: {run.seconds}s")


def test_a_mismatched_mtu_is_reported_with_the_node_and_interface(sim: Sim) -> None:
    usual = mtu(sim, 1)
    sim.node(1, "ip", "link", "set", "dev", "eth0", "mtu", str(usual - 100), check=True, user="root")
    try:
        # New SSH connections (no ControlMaster): one left open by the previous run agreed its segment size at the
        # old MTU, and the worker now drops those segments, so the run would hang until Ansible calls it unreachable.
        run = sim.start("fabric-check-mtu", PLAYBOOK,
                        env={"ANSIBLE_SSH_ARGS": "-o ControlMaster=no -o ServerAliveInterval=30"}).wait(300)
    finally:
        sim.node(1, "ip", "link", "set", "dev", "eth0", "mtu", str(usual), check=True, user="root")
    assert mtu(sim, 1) == usual
    out = flat(run.output)
    assert run.rc != 0, run.evidence()
    # Every problem is in the one report, each naming the node and the interface.
    assert f"{WORKER} eth0: MTU {usual - 100} differs from the {usual} of the other rails" in out, run.evidence()
    assert (f"{HEAD} eth0: ping -M do -s {usual - 28} to {WORKER} eth0 ({WORKER_IP}) failed" in out), run.evidence()
    assert "fabric check: 2 problem(s)" in out, run.evidence()
    # The worker's own pings fit its smaller MTU and get through: only the real problems are reported.
    assert f"{WORKER} eth0 {WORKER_IP}/24: up, mtu {usual - 100}, " in out, run.evidence()
    print(f"fabric_check.yml with one MTU broken: {run.seconds}s")
