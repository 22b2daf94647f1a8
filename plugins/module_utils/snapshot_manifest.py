# -*- coding: utf-8 -*-
# SPDX-License-Identifier: MIT
"""The manifest of a pinned model revision, and checking a snapshot directory against it.

A manifest is what the head learned from the hub: {repo_id, revision, files: [{path, size}]}. Workers
never talk to the hub; after rsync they check their copy against the manifest by path and size. In the
Hugging Face cache a snapshot directory holds symlinks into ../../blobs, so checks follow symlinks and
a dangling link counts as missing.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    size: int


@dataclass(frozen=True)
class Manifest:
    repo_id: str
    revision: str
    files: tuple[ManifestEntry, ...]
    allow_patterns: Optional[tuple[str, ...]] = None
    ignore_patterns: Optional[tuple[str, ...]] = None

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "allow_patterns": list(self.allow_patterns) if self.allow_patterns is not None else None,
            "ignore_patterns": list(self.ignore_patterns) if self.ignore_patterns is not None else None,
            "total_bytes": self.total_bytes,
            "files": [{"path": e.path, "size": e.size} for e in self.files],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Manifest":
        try:
            files = tuple(ManifestEntry(str(f["path"]), int(f["size"])) for f in data["files"])
            allow, ignore = data.get("allow_patterns"), data.get("ignore_patterns")
            return cls(
                repo_id=str(data["repo_id"]),
                revision=str(data["revision"]),
                files=tuple(sorted(files, key=lambda e: e.path)),
                allow_patterns=tuple(allow) if allow is not None else None,
                ignore_patterns=tuple(ignore) if ignore is not None else None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a snapshot manifest: {exc}") from exc


@dataclass(frozen=True)
class SnapshotCheck:
    """Result of comparing a snapshot directory with a manifest."""

    missing: tuple[str, ...] = ()
    # path -> (expected, found) sizes
    wrong_size: dict[str, tuple[int, int]] = field(default_factory=dict)
    present_bytes: int = 0

    @property
    def complete(self) -> bool:
        return not self.missing and not self.wrong_size

    @property
    def bad_paths(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.missing) | set(self.wrong_size)))


def file_size(path: str) -> Optional[int]:
    """Size of the file a path leads to (symlinks followed); None when absent, dangling or not a file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not os.path.isfile(path):
        return None
    return st.st_size


def check_snapshot(snapshot_dir: str, files: Iterable[ManifestEntry]) -> SnapshotCheck:
    """Compare by path and size only: O(files), never reads file contents."""
    missing: list[str] = []
    wrong: dict[str, tuple[int, int]] = {}
    present = 0
    for entry in files:
        found = file_size(os.path.join(snapshot_dir, entry.path))
        if found is None:
            missing.append(entry.path)
        elif found != entry.size:
            wrong[entry.path] = (entry.size, found)
        else:
            present += found
    return SnapshotCheck(missing=tuple(missing), wrong_size=wrong, present_bytes=present)


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Readers (a progress poller, a worker) never see a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_manifest(path: str) -> Manifest:
    data = read_json(path)
    if data is None:
        raise ValueError(f"cannot read a manifest from {path}")
    return Manifest.from_dict(data)


def save_manifest(path: str, manifest: Manifest) -> None:
    write_json_atomic(path, manifest.to_dict())


# The marker says "this node holds every file of this revision"; it is keyed by revision so a changed
# pin never reuses an old marker, and it records the manifest's totals as a cheap sanity check.
def marker_content(manifest: Manifest) -> dict[str, Any]:
    return {
        "repo_id": manifest.repo_id,
        "revision": manifest.revision,
        "files": len(manifest.files),
        "total_bytes": manifest.total_bytes,
    }


def marker_matches(marker_path: str, manifest: Manifest) -> bool:
    return read_json(marker_path) == marker_content(manifest)


@dataclass(frozen=True)
class VerifyOutcome:
    """What snapshot_verify found and what it did (or, in check mode, would do) about the marker."""

    check: SnapshotCheck
    marker_action: str  # "write", "remove" or "keep"

    @property
    def changed(self) -> bool:
        return self.marker_action != "keep"


def decide_marker(check: SnapshotCheck, marker_present: bool, marker_current: bool) -> str:
    """The marker may only claim a verified copy: written when complete, removed when it would lie."""
    if check.complete:
        return "keep" if marker_current else "write"
    return "remove" if marker_present else "keep"


def verify_snapshot(snapshot_path: str, manifest: Manifest, marker_path: str, check_mode: bool) -> VerifyOutcome:
    check = check_snapshot(snapshot_path, manifest.files)
    action = decide_marker(check, os.path.lexists(marker_path), marker_matches(marker_path, manifest))
    if not check_mode:
        if action == "write":
            write_json_atomic(marker_path, marker_content(manifest))
        elif action == "remove":
            os.unlink(marker_path)
    return VerifyOutcome(check, action)
