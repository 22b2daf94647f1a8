"""Lay generated models out as git repositories that olah serves as a Hugging Face endpoint.

olah's offline mirror reads `MIRRORS/models/ORG/REPO` git repositories (branch `main`). Commits use a
fixed author, committer and date, so a revision sha depends only on the files: the simulated cluster
can pin `revision:` in its inventory and still get the same sha on every machine.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

_FIXED_IDENTITY = {
    "GIT_AUTHOR_NAME": "sparkops-sim",
    "GIT_AUTHOR_EMAIL": "sim@sparkops.invalid",
    "GIT_COMMITTER_NAME": "sparkops-sim",
    "GIT_COMMITTER_EMAIL": "sim@sparkops.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
}


def _git(repo: Path, *args: str) -> str:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(repo),
        # Ignore the machine's git config: hooks, signing or templates would change the sha.
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        **_FIXED_IDENTITY,
    }
    done = subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def mirror_repo_path(mirrors_dir: Path, repo_id: str) -> Path:
    org, name = repo_id.split("/", 1)
    return mirrors_dir / "models" / org / name


def publish_model(model_dir: Path, mirrors_dir: Path, repo_id: str, message: str = "upload model") -> str:
    """Make `repo_id` a one-commit git repo holding `model_dir`'s files; return the commit sha."""
    repo = mirror_repo_path(mirrors_dir, repo_id)
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True)
    for source in sorted(model_dir.rglob("*")):
        if source.is_file():
            target = repo / source.relative_to(model_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    _git(repo, "init", "--quiet", "--initial-branch=main")
    _git(repo, "add", "--all")
    _git(repo, "commit", "--quiet", "--no-gpg-sign", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def add_commit(mirrors_dir: Path, repo_id: str, files: dict[str, bytes], message: str) -> str:
    """Add or replace files in a published repo as a new commit on main; return the new sha."""
    repo = mirror_repo_path(mirrors_dir, repo_id)
    for rel, data in files.items():
        target = repo / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    _git(repo, "add", "--all")
    _git(repo, "commit", "--quiet", "--no-gpg-sign", "-m", message)
    return _git(repo, "rev-parse", "HEAD")
