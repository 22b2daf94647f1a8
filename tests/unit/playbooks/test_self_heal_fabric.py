# SPDX-License-Identifier: MIT
"""The supervisor's GID re-check as Ansible configures it (roles/self_heal/tasks/fabric.yml, fabric_record.yml and
install.yml's config): with RDMA on, each node's entry is the GID index and rails its fabric stage chose (only
what the re-check reads); with RDMA off the config has no node to re-check; a run without the fabric stage and no
usable fabric fails naming the node. Runs ansible-playbook in check mode against two inventory hosts that are
both this machine (connection local); only the rendered config is written, to a temporary file."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable, Optional

import yaml

from ansible_collections.sparkops.glm53.plugins.module_utils import self_heal as sh

REPO = Path(__file__).resolve().parents[3]
# The conftest.py fixture check_run: one `ansible-playbook --check` against two local inventory hosts.
CheckRun = Callable[..., subprocess.CompletedProcess[str]]


def _rail(hca: str, netdev: str, address: str) -> dict:
    # A rail as fabric_facts returns it (dataclasses.asdict of fabric.Rail).
    return {"netdev": netdev, "address": address, "prefixlen": 24, "operstate": "up", "mtu": 9000,
            "speed_mbps": 200000, "hca": hca, "port": 1, "gid_index": 3}


def _facts(last: int) -> dict:
    rails = [_rail("rocep1s0f1", "enp1s0f1np1", "10.0.0.%d" % last),
             _rail("roceP2p1s0f1", "enP2p1s0f1np1", "192.168.101.%d" % last)]
    return {"netdev": "enp1s0f1np1", "operstate": "up", "mtu": 9000, "hca": "rocep1s0f1", "port": 1,
            "gid_index": 3, "rails": rails, "env": {"NCCL_IB_GID_INDEX": "3"}, "problems": [], "changed": False}


def _run(check_run: CheckRun, tmp_path: Path, rdma: bool, with_facts: bool = True) -> "tuple[subprocess.CompletedProcess[str], Path]":
    [install] = [t for t in yaml.safe_load((REPO / "roles/self_heal/tasks/install.yml").read_text())
                 if t.get("name") == "Write the supervisor's configuration"]
    out = tmp_path / "fabric.json"
    tasks = [{"name": "What the fabric stage registers",
              "ansible.builtin.set_fact": {"_fabric_facts": "{{ facts[inventory_hostname] }}"},
              "vars": {"facts": {"spark-head": _facts(1), "spark-worker": _facts(2)}}}] if with_facts else []
    tasks += [{"name": "The fabric the supervisor re-checks",
               "ansible.builtin.import_role": {"name": "sparkops.glm53.self_heal", "tasks_from": "fabric.yml"}},
              {"name": "Write what install.yml puts in the supervisor's config", "run_once": True,
               "check_mode": False,
               "ansible.builtin.copy": {"dest": str(out), "mode": "0644", "content": "{{ fabric | to_nice_json }}"},
               "vars": {"fabric": install["vars"]["_self_heal_settings"]["fabric"]}}]
    play = [{"hosts": "sparks", "gather_facts": True, "gather_subset": ["min"], "vars": {"glm53_rdma": rdma},
             "roles": [{"role": "sparkops.glm53.glm53"}], "tasks": tasks}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    proc = check_run(tmp_path / "play.yml")
    return proc, out


def _config(out: Path) -> Optional[dict]:
    return json.loads(out.read_text()) if out.exists() else None


def test_with_rdma_each_node_gets_its_gid_index_and_rails(check_run: CheckRun, tmp_path: Path) -> None:
    proc, out = _run(check_run, tmp_path, rdma=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    fabric = _config(out)
    assert fabric is not None
    assert fabric["nodes"]["spark-worker"] == {"gid_index": 3, "rails": [
        {"netdev": "enp1s0f1np1", "address": "10.0.0.2", "hca": "rocep1s0f1", "port": 1},
        {"netdev": "enP2p1s0f1np1", "address": "192.168.101.2", "hca": "roceP2p1s0f1", "port": 1}]}
    ranks = [{"rank": 0, "node": "spark-head", "container": "glm53-rank0"},
             {"rank": 1, "node": "spark-worker", "container": "glm53-rank1", "ssh": "spark@10.0.0.2"}]
    config = sh.SupervisorConfig.from_dict({"url": "u", "served_model_name": "m", "state_path": "/s",
                                            "lock_path": "/l", "lock_token": "t", "ranks": ranks, "fabric": fabric})
    assert [str(r.address) for r in config.fabric["spark-head"].rails] == ["10.0.0.1", "192.168.101.1"]


def test_without_rdma_the_config_has_no_node_to_recheck(check_run: CheckRun, tmp_path: Path) -> None:
    proc, out = _run(check_run, tmp_path, rdma=False, with_facts=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert _config(out) == {"nodes": {}}
    said = " ".join(proc.stdout.split())
    # RDMA off: fabric.yml's include is skipped, so its discovery never runs.
    assert "Discover the fabric the ranks use" not in said, "RDMA off discovers nothing"
    assert "Record the GID index and rails the supervisor re-checks" in said, said


def test_a_run_without_the_fabric_stage_discovers_it_and_fails_naming_the_node(check_run: CheckRun, tmp_path: Path) -> None:
    # This machine has no interface with 10.0.0.x and no RDMA: discovery finds nothing usable.
    proc, out = _run(check_run, tmp_path, rdma=True, with_facts=False)
    said = " ".join(proc.stdout.split())
    assert proc.returncode != 0 and not out.exists()
    assert "Discover the fabric the ranks use (a run without the fabric stage)" in said, said
    assert "spark-head: no RoCE GID index for the supervisor to re-check" in said, said
    assert "run playbooks/fabric_check.yml, then site.yml" in said
