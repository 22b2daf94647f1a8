# SPDX-License-Identifier: MIT
"""ansible-playbook in check mode against two inventory hosts that are both this machine (connection local):
the real roles and playbooks, with nothing changed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[3]
LOCAL_PAIR = """\
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

CheckRun = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture()
def check_run(tmp_path: Path) -> CheckRun:
    """run(playbook, *args, inventory=LOCAL_PAIR, timeout=180): one `ansible-playbook --check` of ``playbook``."""
    def run(playbook: Path, *args: str, inventory: str = LOCAL_PAIR,
            timeout: float = 180) -> "subprocess.CompletedProcess[str]":
        hosts = tmp_path / "hosts.yml"
        hosts.write_text(inventory)
        # Not under coverage.py (its subprocess patch passes these on): the plugins run in Ansible's forked workers,
        # which never save coverage data, so measuring only made each run slower (21 tests: 225 CPU-s to 126).
        inherited = {k: v for k, v in os.environ.items() if k not in ("COVERAGE_PROCESS_CONFIG", "COVERAGE_PROCESS_START")}
        env = dict(inherited, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
                   ANSIBLE_COLLECTIONS_PATH=str(REPO / ".collections"),
                   ANSIBLE_LOCAL_TEMP=str(tmp_path / "local"), ANSIBLE_REMOTE_TMP=str(tmp_path / "remote"),
                   ANSIBLE_NOCOLOR="1")
        return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(hosts), "--check",
                               str(playbook), *args], capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=timeout, check=False)
    return run
