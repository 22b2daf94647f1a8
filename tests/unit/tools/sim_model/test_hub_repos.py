# SPDX-License-Identifier: MIT
"""The simulated hub's git repos: publishing again leaves a published repo alone, and a revision added on a
side branch leaves main where it was."""
from __future__ import annotations

import subprocess
from pathlib import Path

from tools.sim_model.hub_repos import add_commit, mirror_repo_path, publish_model

REPO_ID = "sim/tiny"


def model(tmp_path: Path, weights: bytes = b"w1") -> Path:
    path = tmp_path / "model"
    (path / "sub").mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "sub" / "model.safetensors").write_bytes(weights)
    return path


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_publishing_the_same_files_again_keeps_the_repo(tmp_path: Path) -> None:
    mirrors = tmp_path / "mirrors"
    sha = publish_model(model(tmp_path), mirrors, REPO_ID)
    marker = mirror_repo_path(mirrors, REPO_ID) / ".git" / "kept"
    marker.write_text("")  # gone if the repo were removed and made again
    assert publish_model(model(tmp_path), mirrors, REPO_ID) == sha
    assert marker.exists()


def test_changed_files_or_an_extra_commit_are_published_anew(tmp_path: Path) -> None:
    mirrors = tmp_path / "mirrors"
    repo = mirror_repo_path(mirrors, REPO_ID)
    first = publish_model(model(tmp_path), mirrors, REPO_ID)
    second = publish_model(model(tmp_path, b"w2"), mirrors, REPO_ID)
    assert second != first and (repo / "sub" / "model.safetensors").read_bytes() == b"w2"
    add_commit(mirrors, REPO_ID, {"UPGRADE.md": b"2\n"}, "revision 2")
    assert publish_model(model(tmp_path, b"w2"), mirrors, REPO_ID) == second
    assert git(repo, "rev-list", "--count", "main") == "1" and not (repo / "UPGRADE.md").exists()


def test_a_commit_on_a_side_branch_leaves_main_and_its_files(tmp_path: Path) -> None:
    mirrors = tmp_path / "mirrors"
    repo = mirror_repo_path(mirrors, REPO_ID)
    first = publish_model(model(tmp_path), mirrors, REPO_ID)
    new = add_commit(mirrors, REPO_ID, {"UPGRADE.md": b"2\n"}, "revision 2", branch="upgrade")
    assert new != first
    assert git(repo, "rev-parse", "main") == first and git(repo, "rev-parse", "upgrade") == new
    assert git(repo, "branch", "--show-current") == "main" and not (repo / "UPGRADE.md").exists()
    assert git(repo, "show", "%s:UPGRADE.md" % new) == "2"
    assert publish_model(model(tmp_path), mirrors, REPO_ID) == first
