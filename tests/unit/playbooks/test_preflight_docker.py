# SPDX-License-Identifier: MIT
"""Preflight's docker check (roles/preflight/tasks/docker.yml): one docker call asks whether docker answers the SSH
user and reads our own rank container; a docker that does not answer fails on every node with the daemon's
error, naming the user and the node. Runs the real task file in check mode against two inventory hosts that are
both this machine (connection local), with DOCKER_HOST pointing at a socket nothing listens on."""
from __future__ import annotations

import getpass
import re
import subprocess
from pathlib import Path
from typing import Callable

import yaml

# The conftest.py fixture check_run: one `ansible-playbook --check` against two local inventory hosts.
CheckRun = Callable[..., subprocess.CompletedProcess[str]]


def test_a_docker_that_does_not_answer_fails_on_every_node_naming_user_and_node(
        check_run: CheckRun, tmp_path: Path) -> None:
    socket = tmp_path / "no-docker.sock"
    play = [{"hosts": "sparks", "gather_facts": True, "gather_subset": ["min"],
             "environment": {"DOCKER_HOST": "unix://%s" % socket},
             "roles": [{"role": "sparkops.glm53.glm53"}],
             "tasks": [{"name": "Docker on every node",
                        "ansible.builtin.import_role": {"name": "sparkops.glm53.preflight", "tasks_from": "docker.yml"}}]}]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play, sort_keys=False))
    proc = check_run(tmp_path / "play.yml")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, out
    for node in ("spark-head", "spark-worker"):
        said = re.search(r"Docker is not usable by (\S+) on %s: (.*?)\. Install Docker" % node, out)
        assert said, out
        # The user the play runs as (the SSH user of a real run), and the docker client's own error.
        assert said.group(1) == getpass.getuser(), out
        assert said.group(2).startswith("Error connecting: "), out
        assert re.search(r"%s : ok=\d+ changed=0 unreachable=0 failed=1" % node, out), out
