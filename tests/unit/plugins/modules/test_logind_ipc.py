# SPDX-License-Identifier: MIT
"""The logind_ipc module as Ansible runs it, against file-system trees of a DGX OS node and of a container."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict

ModuleRunner = Callable[..., Dict[str, Any]]
SPARK = {"user": "spark", "uid": 1000, "host": "spark-worker"}


def node(root: Path, logind_conf: str = "[Login]\n#RemoveIPC=yes\n") -> Path:
    """A systemd-booted node with logind installed and the given /etc/systemd/logind.conf."""
    (root / "run/systemd/system").mkdir(parents=True)
    (root / "usr/lib/systemd").mkdir(parents=True)
    (root / "usr/lib/systemd/systemd-logind").write_text("")
    (root / "etc/systemd").mkdir(parents=True)
    (root / "etc/systemd/logind.conf").write_text(logind_conf)
    return root


def test_a_dgx_os_node_with_the_defaults_is_at_risk(tmp_path: Path, run_module: ModuleRunner) -> None:
    result = run_module("logind_ipc", dict(SPARK, root=str(node(tmp_path))), check=True)
    assert result["status"] == "at risk" and result["changed"] is False
    assert result["files"] == ["/etc/systemd/logind.conf"]
    assert result["user"] == {"name": "spark", "uid": 1000, "lingering": False}
    assert "sudo loginctl enable-linger spark" in result["problem"] and "spark-worker" in result["problem"]


def test_the_linger_file_makes_it_safe(tmp_path: Path, run_module: ModuleRunner) -> None:
    root = node(tmp_path)
    (root / "var/lib/systemd/linger").mkdir(parents=True)
    (root / "var/lib/systemd/linger/spark").write_text("")
    result = run_module("logind_ipc", dict(SPARK, root=str(root)))
    assert result["status"] == "safe" and result["user"]["lingering"] is True and not result["problem"]


def test_a_drop_in_with_removeipc_off_makes_it_safe_and_a_bad_value_is_noted(
        tmp_path: Path, run_module: ModuleRunner) -> None:
    root = node(tmp_path, "[Login]\nRemoveIPC=maybe\n")
    (root / "etc/systemd/logind.conf.d").mkdir()
    (root / "etc/systemd/logind.conf.d/50-glm53-keep-ipc.conf").write_text("[Login]\nRemoveIPC=no\n")
    result = run_module("logind_ipc", dict(SPARK, root=str(root)))
    assert result["status"] == "safe"
    assert result["reason"] == "RemoveIPC=no in /etc/systemd/logind.conf.d/50-glm53-keep-ipc.conf:2"
    assert result["notes"] == ["/etc/systemd/logind.conf:2: RemoveIPC=maybe is not a boolean and is ignored"]


def test_a_container_without_systemd_is_not_applicable(tmp_path: Path, run_module: ModuleRunner) -> None:
    # The simulated Sparks: sshd and dockerd under a shell script as PID 1, no /run/systemd/system.
    (tmp_path / "etc").mkdir()
    result = run_module("logind_ipc", dict(SPARK, root=str(tmp_path)))
    assert result["status"] == "not applicable" and not result["problem"] and result["files"] == []
    assert "no systemd-logind" in result["reason"]


def test_systemd_without_logind_is_not_applicable(tmp_path: Path, run_module: ModuleRunner) -> None:
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    result = run_module("logind_ipc", dict(SPARK, root=str(tmp_path)))
    assert result["status"] == "not applicable" and result["reason"] == "no systemd-logind installed"


def test_root_is_exempt(tmp_path: Path, run_module: ModuleRunner) -> None:
    result = run_module("logind_ipc", {"user": "root", "root": str(node(tmp_path))})
    assert result["status"] == "exempt" and result["user"]["uid"] == 0


def test_an_unknown_user_without_a_uid_fails_naming_it(tmp_path: Path, run_module: ModuleRunner) -> None:
    result = run_module("logind_ipc", {"user": "no-such-user-glm53", "root": str(node(tmp_path))})
    assert result["failed"] and "no-such-user-glm53 is not in the password database" in result["msg"]
