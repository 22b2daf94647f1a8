# SPDX-License-Identifier: MIT
"""The supervisor's memory step as Ansible configures it (roles/self_heal/tasks/privilege.yml and install.yml's
config): each node's budget request is the one roles/vllm_ranks/tasks/memory.yml judges before a start (the
same _glm53_memory_request, the checkpoint sizes read from the weights stage's result), a node where the drop
right was installed runs it through `sudo -n` (or directly as root), and a node where become failed gets no
drop command and the reason. Runs ansible-playbook in check mode against two inventory hosts that are both this
machine (connection local); only the rendered config is written, to a temporary file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import yaml

from ansible_collections.sparkops.glm53.plugins.module_utils import self_heal as sh

REPO = Path(__file__).resolve().parents[3]
# The conftest.py fixture check_run: one `ansible-playbook --check` against two local inventory hosts.
CheckRun = Callable[..., subprocess.CompletedProcess[str]]
GIB = 1 << 30
# The head logs in as root (no become, so the drop runs without sudo); the worker as an ordinary user whose
# become fails, as where sudo asks for a password: a sudo that does not exist (and a become user other than the
# connection's, since Ansible skips become from root to root, and these local hosts run as the test's user).
INVENTORY = """\
all:
  children:
    sparks:
      hosts:
        spark-head: {glm53_fabric_ip: 10.0.0.1, ansible_user: root}
        spark-worker: {glm53_fabric_ip: 10.0.0.2, ansible_user: spark, ansible_become_exe: /nonexistent/sudo,
                       ansible_become_user: glm53-test-nobody}
  vars:
    ansible_connection: local
    ansible_python_interpreter: %s
""" % sys.executable


def _install_task(name: str) -> dict:
    [task] = [t for t in yaml.safe_load((REPO / "roles/self_heal/tasks/install.yml").read_text())
              if t.get("name") == name]
    return task


def _playbook(out: Path) -> list:
    return [{
        "hosts": "sparks", "gather_facts": True, "gather_subset": ["min"],
        "roles": [{"role": "sparkops.glm53.glm53"}],
        "tasks": [
            {"name": "The checkpoint sizes as the weights stage registers them on the head",
             "ansible.builtin.set_fact": {"_model_weights_head": {"results": [
                 {"item": {"name": "model"}, "total_bytes": 164 * GIB},
                 {"item": {"name": "draft"}, "total_bytes": 3 * GIB}]}},
             "when": "inventory_hostname == 'spark-head'"},
            {"name": "The drop right",
             "ansible.builtin.import_role": {"name": "sparkops.glm53.self_heal", "tasks_from": "privilege.yml"}},
            {"name": "Write what install.yml puts in the supervisor's config", "run_once": True, "check_mode": False,
             "ansible.builtin.copy": {"dest": str(out), "mode": "0644", "content": "{{ memory | to_nice_json }}"},
             "vars": {"memory": _install_task("Write the supervisor's configuration")["vars"]["_self_heal_settings"][
                 "memory"]}},
            dict(_install_task("Say what the supervisor watches"), run_once=True),
        ]}]


def test_each_node_gets_memory_yml_s_request_and_its_drop_or_why_not(check_run: CheckRun, tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    (tmp_path / "play.yml").write_text(yaml.safe_dump(_playbook(out), sort_keys=False))
    proc = check_run(tmp_path / "play.yml", inventory=INVENTORY)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    said = " ".join(proc.stdout.split())
    assert ("after dropping its page cache (/usr/local/sbin/glm53-drop-caches); the drop is SKIPPED "
            "on spark-worker: site.yml could not install the drop on spark-worker (become failed:") in said, said
    config = sh.MemoryConfig.from_dict(json.loads(out.read_text()))
    assert config.drop_page_cache
    head, worker = config.nodes["spark-head"], config.nodes["spark-worker"]
    # The spec defaults on a GB10: 0.85, 4 GiB kept, 5 GiB overhead; 164 GiB over TP 2, the draft on rank 0 only.
    assert head.request == sh.budget_request({
        "gpu": True, "gpu_memory_utilization": 0.85, "kv_cache_memory_bytes": 0, "max_model_len": 850000,
        "weights_bytes": 82 * GIB + 3 * GIB, "overhead_bytes": 5 * GIB, "kv_bytes_per_token": 17014,
        "reserve_bytes": 4 * GIB})
    assert worker.request.weights_bytes == 82 * GIB
    # Root needs no sudo; the worker's become failed, so it has no drop and says why and what to do.
    assert head.drop_argv == ("/usr/local/sbin/glm53-drop-caches",) and head.drop_refused == ""
    assert worker.drop_argv == ()
    assert worker.drop_refused.startswith("site.yml could not install the drop on spark-worker (become failed:")
    assert "allow spark passwordless sudo, or set glm53_drop_page_cache=false" in worker.drop_refused
