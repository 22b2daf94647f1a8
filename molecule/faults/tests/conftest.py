# SPDX-License-Identifier: MIT
"""Drive the real playbooks against the simulated Sparks and break things on purpose.

Every run of site.yml/stop.yml goes through `Sim.start()`/`Sim.site()`: the same command line a user types
(inventory/sim, the API key, HF token and registry password from an ansible-vault file made for this
session), its output kept under .cache/faults-logs/TIME/ as evidence and scanned for secrets at the end. Nodes
are reached with `docker exec --user spark glm53-sim-nodeN` (the controller made them; root only where a test
needs it), rank containers inside them with the node's own docker.
"""
from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest
import yaml

REPO = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY") or Path(__file__).resolve().parents[3])
INVENTORY = REPO / "inventory" / "sim"
SIM_VARS = yaml.safe_load((INVENTORY / "group_vars" / "sparks.yml").read_text())
HOSTS = yaml.safe_load((INVENTORY / "hosts.yml").read_text())["all"]["children"]["sparks"]["hosts"]
NAMES = list(HOSTS)  # rank order: the head first
HEAD_IP = HOSTS[NAMES[0]]["glm53_fabric_ip"]
PORT = 8888
STOP_TIMEOUT = int(SIM_VARS["glm53_stop_timeout"])
NODE = "glm53-sim-node{}"
RANK = "glm53-rank{}"
# The owner's account the playbooks log in as (a DGX OS Spark's; docker/sim/node.Dockerfile): tests act on the
# nodes as that user too, and as root only where a test breaks something only root can.
USER = SIM_VARS["ansible_user"]
HOME = "/root" if USER == "root" else "/home/" + USER
HF_CACHE = HOME + "/.cache/huggingface"
CACHE = HOME + "/.cache/glm53"
LOCK = CACHE + "/run.lock"


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 1.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %ss waiting for %s" % (timeout, what or predicate))
        time.sleep(interval)


def recap(output: str) -> Dict[str, Dict[str, int]]:
    """PLAY RECAP counters per host."""
    counts: Dict[str, Dict[str, int]] = {}
    for line in output.split("PLAY RECAP")[-1].splitlines()[1:]:
        if ":" not in line or "=" not in line:
            continue
        host, rest = line.split(":", 1)
        counts[host.strip()] = {k: int(v) for k, v in (item.split("=") for item in rest.split())}
    return counts


@dataclass
class Run:
    """One ansible-playbook run; `output` is stdout+stderr once it has finished."""

    name: str
    argv: List[str]
    log: Path
    proc: subprocess.Popen
    started: float
    ended: Optional[float] = None
    rc: Optional[int] = None

    def wait(self, timeout: float = 900) -> "Run":
        try:
            self.rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("%s did not finish within %ss; log %s:\n%s" % (self.name, timeout, self.log, self.tail()))
        self.ended = time.monotonic()
        return self

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def seconds(self) -> float:
        return round((self.ended or time.monotonic()) - self.started, 1)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])

    def evidence(self) -> str:
        return "%s (rc %s, %ss, log %s):\n%s" % (self.name, self.rc, self.seconds, self.log, self.tail())


@dataclass
class Sim:
    logs: Path
    vault: Path
    vault_password: Path
    secrets: Dict[str, str]
    runs: List[Run] = field(default_factory=list)

    # -- the controller side
    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(
            ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
            ANSIBLE_COLLECTIONS_PATH=str(REPO / ".collections"),
            ANSIBLE_NOCOLOR="1",
            ANSIBLE_FORCE_COLOR="0",
            # A timestamp and duration for every task: the evidence for "how fast".
            ANSIBLE_CALLBACKS_ENABLED="ansible.posix.profile_tasks,sparkops.glm53.module_cache",
            PATH="%s%s%s" % (Path(sys.executable).parent, os.pathsep, env.get("PATH", "")),
        )
        return env

    def start(self, name: str, playbook: str, *args: str, inventories: tuple = (),
              env: Optional[Dict[str, str]] = None) -> Run:
        argv = ["ansible-playbook", "-i", str(INVENTORY)]
        for extra in inventories:
            argv += ["-i", str(extra)]
        # Self-healing off unless a test turns it on (a later -e wins): these tests break ranks on purpose to
        # see how Ansible reports it, which a supervisor restarting the group would hide.
        argv += [str(REPO / playbook), "-e", "@%s" % self.vault, "--vault-password-file", str(self.vault_password),
                 "-e", "glm53_self_heal=false", *args]
        log = self.logs / ("%02d-%s.log" % (len(self.runs) + 1, name))
        handle = log.open("w")
        handle.write("$ %s\n" % shlex.join(argv))
        handle.flush()
        proc = subprocess.Popen(argv, cwd=REPO, env=dict(self.env(), **(env or {})), stdin=subprocess.DEVNULL,
                                stdout=handle, stderr=subprocess.STDOUT)
        run = Run(name, argv, log, proc, time.monotonic())
        self.runs.append(run)
        return run

    def site(self, name: str, *args: str, timeout: float = 900, **kw: Any) -> Run:
        return self.start(name, "site.yml", *args, **kw).wait(timeout)

    # -- the nodes
    def node(self, rank: int, *argv: str, check: bool = False, timeout: float = 60,
             user: str = USER) -> subprocess.CompletedProcess:
        proc = subprocess.run(["docker", "exec", "--user", user, NODE.format(rank), *argv], capture_output=True,
                              text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise AssertionError("%s on node %d failed (%d): %s" % (argv, rank, proc.returncode, proc.stderr))
        return proc

    def sh(self, rank: int, script: str, **kw: Any) -> subprocess.CompletedProcess:  # same keywords as node()
        return self.node(rank, "sh", "-c", script, **kw)

    def container(self, rank: int, name: Optional[str] = None) -> Optional[Dict[str, Any]]:
        proc = self.node(rank, "docker", "inspect", name or RANK.format(rank))
        return json.loads(proc.stdout)[0] if proc.returncode == 0 else None

    def running(self, rank: int) -> bool:
        info = self.container(rank)
        return bool(info and info["State"]["Running"])

    def remove_ranks(self) -> None:
        for rank in range(len(NAMES)):
            self.node(rank, "docker", "rm", "-f", RANK.format(rank))

    def lock_holder(self) -> Optional[Dict[str, Any]]:
        proc = self.node(0, "cat", LOCK + "/holder.json")
        return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None

    def listeners(self, rank: int, port: int) -> List[str]:
        out = self.node(rank, "ss", "-Hltn").stdout
        return [line.split()[3] for line in out.splitlines() if line.split()[3].rsplit(":", 1)[-1] == str(port)]


def api(path: str, key: Optional[str] = None, host: str = HEAD_IP, body: Optional[dict] = None,
        port: int = PORT) -> tuple:
    """(status, body) of one request to the head's API; status 0 when nothing answers."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request("http://%s:%d%s" % (host, port, path), data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


# The modules' order on the shared cluster (tests within a module keep file order). Each module leaves the group
# as the next one finds it best: the settings guard follows the rollback test, whose last run leaves the group
# serving, so the guard needs no engine start of its own (it started one when it came after self-healing, whose
# last test stops everything: 67 s measured); self-healing removes the ranks itself to time a real start.
MODULE_ORDER = ("test_fabric_check.py", "test_faults.py", "test_image_ship.py", "test_limit.py", "test_rollback.py",
                "test_settings_guard.py", "test_self_healing.py")


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    unknown = sorted({item.path.name for item in items} - set(MODULE_ORDER))
    # A new module must be placed on purpose: where it runs decides what state it finds.
    assert not unknown, "add %s to MODULE_ORDER in %s" % (unknown, __file__)
    items.sort(key=lambda item: MODULE_ORDER.index(item.path.name))


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(3)
        return sock.connect_ex((host, port)) == 0


@pytest.fixture(scope="session")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    base = tmp_path_factory.mktemp("faults")
    # Outside molecule's ephemeral directory, which is pruned after a passing run: the evidence stays.
    logs = REPO / ".cache" / "faults-logs" / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    # Secrets made for this session and kept in ansible-vault, the way README tells users to keep theirs.
    values = {
        "glm53_api_key": "sk-glm53-faults-" + secrets.token_hex(12),
        "glm53_hf_token": "hf_faults" + secrets.token_hex(12),
        # The simulated registry's one user (its htpasswd is made from inventory/sim): a real login, from the vault.
        "glm53_registry_username": SIM_VARS["glm53_registry_username"],
        "glm53_registry_password": SIM_VARS["glm53_registry_password"],
    }
    password = base / "vault-password"
    password.write_text(secrets.token_hex(16) + "\n")
    password.chmod(0o600)
    vault = base / "vault.yml"
    vault.write_text(yaml.safe_dump(values))
    env = Sim(logs, vault, password, values).env()
    subprocess.run(["ansible-vault", "encrypt", "--vault-password-file", str(password), str(vault)], env=env,
                   check=True, capture_output=True)
    assert vault.read_text().startswith("$ANSIBLE_VAULT;")
    session = Sim(logs, vault, password, values)
    yield session
    # A test that failed half-way may leave a background run behind: never let it outlive the session.
    for run in session.runs:
        if run.proc.poll() is None:
            run.proc.terminate()
            try:
                run.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                run.proc.kill()
