# SPDX-License-Identifier: MIT
"""Pruning old revisions of a model from a Hugging Face hub cache (the head's, or a worker's rsynced copy).

One repo's cache dir is ``<cache>/models--ORG--NAME`` with ``blobs/<hash>`` (the data),
``snapshots/<sha>/<relpath>`` (symlinks to ``../../blobs/<hash>``) and ``refs/<branch>`` (a sha). Beside
that the collection keeps, per revision, the manifest ``models--ORG--NAME/manifests/<sha>.json``
(hf_snapshot.manifest_path) and the worker's sync marker ``<cache>/.glm53-sync/models--ORG--NAME@<sha>.json``
(cluster.checkpoint_paths).

Pruning a revision removes its snapshot dir, the blobs no kept revision references, its manifest and marker,
its ``.no_exist/<sha>`` dir and the refs naming it. A blob shared with a kept revision stays, and so do
``.incomplete`` partial blobs and blobs no snapshot references (a download may be writing them). A snapshot
file that is a regular file (not a link into blobs/) counts its own size.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Iterable, Optional

from ansible_collections.sparkops.glm53.plugins.module_utils.hf_snapshot import (
    is_commit_sha,
    manifest_path,
    repo_cache_dir,
    snapshot_dir,
)

MARKER_DIR = ".glm53-sync"
INCOMPLETE_SUFFIX = ".incomplete"
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def repo_folder_name(repo_id: str) -> str:
    return os.path.basename(repo_cache_dir("", repo_id))


def marker_path(cache_dir: str, repo_id: str, sha: str) -> str:
    """As cluster.checkpoint_paths names it: beside the repo dirs, so the head's rsync never carries it."""
    return os.path.join(cache_dir, MARKER_DIR, f"{repo_folder_name(repo_id)}@{sha}.json")


# ---------------------------------------------------------------- scanning


@dataclass(frozen=True)
class SnapshotFile:
    """One file of a snapshot: a link into blobs/ (blob set) or anything else (blob None, own size)."""

    path: str
    blob: Optional[str]
    size: int


@dataclass(frozen=True)
class RevisionScan:
    revision: str
    files: tuple[SnapshotFile, ...] = ()
    has_snapshot: bool = True

    @property
    def blobs(self) -> frozenset[str]:
        return frozenset(f.blob for f in self.files if f.blob is not None)

    @property
    def own_bytes(self) -> int:
        """Bytes of the files that are not links into blobs/ (regular files on a worker)."""
        return sum(f.size for f in self.files if f.blob is None)


@dataclass(frozen=True)
class RepoScan:
    cache_dir: str
    repo_id: str
    revisions: dict[str, RevisionScan]
    blob_sizes: dict[str, int]
    refs: dict[str, str]  # ref name relative to refs/ (e.g. "main", "pr/1") -> sha it names

    @property
    def repo_dir(self) -> str:
        return repo_cache_dir(self.cache_dir, self.repo_id)


def _snapshot_files(root: str, blobs_dir: str, rel: str = "") -> list[SnapshotFile]:
    found: list[SnapshotFile] = []
    try:
        entries = sorted(os.scandir(os.path.join(root, rel)), key=lambda e: e.name)
    except OSError:
        return found
    for entry in entries:
        rel_path = os.path.join(rel, entry.name)
        if entry.is_symlink():
            target = os.path.realpath(entry.path)
            blob = os.path.basename(target)
            if os.path.dirname(target) == blobs_dir and not blob.endswith(INCOMPLETE_SUFFIX):
                found.append(SnapshotFile(rel_path, blob, 0))
            else:
                # A link elsewhere: removing it frees nothing.
                found.append(SnapshotFile(rel_path, None, 0))
        elif entry.is_dir(follow_symlinks=False):
            found.extend(_snapshot_files(root, blobs_dir, rel_path))
        else:
            try:
                size = entry.stat(follow_symlinks=False).st_size
            except OSError:
                size = 0
            found.append(SnapshotFile(rel_path, None, size))
    return found


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _read_refs(refs_dir: str) -> dict[str, str]:
    refs: dict[str, str] = {}
    for dirpath, _dirs, files in os.walk(refs_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                with open(path) as handle:
                    refs[os.path.relpath(path, refs_dir)] = handle.read().strip()
            except OSError:
                pass
    return refs


def scan_repo(cache_dir: str, repo_id: str) -> RepoScan:
    """Every revision of one repo found on this node: its snapshot dir (with the blobs it links to), or only
    its manifest or marker (a download that stopped before any file); the sizes of the blobs referenced."""
    repo_dir = repo_cache_dir(cache_dir, repo_id)
    blobs_dir = os.path.realpath(os.path.join(repo_dir, "blobs"))
    snapshots = os.path.join(repo_dir, "snapshots")
    revisions: dict[str, RevisionScan] = {}
    for name in _listdir(snapshots):
        path = os.path.join(snapshots, name)
        if os.path.isdir(path):
            revisions[name] = RevisionScan(name, tuple(_snapshot_files(path, blobs_dir)))
    leftovers = [n[:-len(".json")] for n in _listdir(os.path.join(repo_dir, "manifests")) if n.endswith(".json")]
    prefix = repo_folder_name(repo_id) + "@"
    leftovers += [n[len(prefix):-len(".json")] for n in _listdir(os.path.join(cache_dir, MARKER_DIR))
                  if n.startswith(prefix) and n.endswith(".json")]
    for sha in leftovers:
        if is_commit_sha(sha) and sha not in revisions:
            revisions[sha] = RevisionScan(sha, (), has_snapshot=False)
    blob_sizes: dict[str, int] = {}
    for revision in revisions.values():
        for blob in revision.blobs:
            if blob not in blob_sizes:
                try:
                    blob_sizes[blob] = os.stat(os.path.join(blobs_dir, blob)).st_size
                except OSError:  # a dangling link: nothing to free
                    blob_sizes[blob] = 0
    return RepoScan(cache_dir, repo_id, dict(sorted(revisions.items())), blob_sizes,
                    _read_refs(os.path.join(repo_dir, "refs")))


# ---------------------------------------------------------------- planning


@dataclass(frozen=True)
class PrunedRevision:
    revision: str
    bytes: int  # data freed with it; a blob shared by several pruned revisions counts for the first only


@dataclass(frozen=True)
class PrunePlan:
    scan: RepoScan
    delete: tuple[PrunedRevision, ...]
    kept: tuple[str, ...]  # revisions on disk that stay
    blobs: tuple[str, ...]  # blobs referenced only by deleted revisions
    refs: tuple[str, ...]  # refs naming a deleted revision

    @property
    def freed_bytes(self) -> int:
        return sum(r.bytes for r in self.delete)

    @property
    def revisions(self) -> tuple[str, ...]:
        return tuple(r.revision for r in self.delete)

    @property
    def changed(self) -> bool:
        return bool(self.delete)


def plan_prune(scan: RepoScan, keep: Iterable[str]) -> PrunePlan:
    """Delete every revision on disk that is not in `keep` and is a commit sha (a snapshot dir with another
    name is never ours to judge, so it stays and protects its blobs). Revisions in `keep` that are not on
    disk are ignored."""
    keep_set = set(keep)
    doomed = [r for r in scan.revisions.values() if r.revision not in keep_set and is_commit_sha(r.revision)]
    gone = {r.revision for r in doomed}
    kept = tuple(r for r in scan.revisions if r not in gone)
    protected: set[str] = set()
    for sha in kept:
        protected |= scan.revisions[sha].blobs
    counted: set[str] = set()
    delete = []
    for revision in doomed:
        own = sorted(revision.blobs - protected - counted)
        counted.update(own)
        delete.append(PrunedRevision(revision.revision,
                                     revision.own_bytes + sum(scan.blob_sizes.get(b, 0) for b in own)))
    refs = tuple(sorted(name for name, sha in scan.refs.items() if sha in gone))
    return PrunePlan(scan, tuple(delete), kept, tuple(sorted(counted)), refs)


# ---------------------------------------------------------------- applying


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):  # already gone, or a parent is not a directory
        pass


def apply_prune(plan: PrunePlan) -> None:
    """Remove what the plan names. The order keeps an interrupted prune safe and resumable: refs and markers go
    first (nothing then names or vouches for a revision being removed), the blobs before the snapshot dirs
    that link to them (no blob is left that no snapshot references, which no later scan would find), and
    the manifests last (the next run still finds the revision and finishes the job)."""
    scan = plan.scan
    repo_dir = scan.repo_dir
    for ref in plan.refs:
        _remove(os.path.join(repo_dir, "refs", ref))
    for revision in plan.revisions:
        _remove(marker_path(scan.cache_dir, scan.repo_id, revision))
    for blob in plan.blobs:
        if not blob.endswith(INCOMPLETE_SUFFIX):
            _remove(os.path.join(repo_dir, "blobs", blob))
    for revision in plan.revisions:
        _remove(snapshot_dir(scan.cache_dir, scan.repo_id, revision))
        _remove(os.path.join(repo_dir, ".no_exist", revision))
    for revision in plan.revisions:
        _remove(manifest_path(scan.cache_dir, scan.repo_id, revision))


# ---------------------------------------------------------------- disk verdict


def format_bytes(n: float) -> str:
    """Binary units with one decimal: 512 B, 1.5 KiB, 164.0 GiB."""
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in _UNITS[1:]:
        value /= 1024
        if value < 1024:
            break
    return f"{value:.1f} {unit}"


@dataclass(frozen=True)
class DiskVerdict:
    free_bytes: int
    needed_bytes: int  # what the wanted revisions still need (files not yet present)
    prunable_bytes: int  # what a prune would free

    @property
    def fits_now(self) -> bool:
        return self.free_bytes >= self.needed_bytes

    @property
    def fits_after_prune(self) -> bool:
        return self.free_bytes + self.prunable_bytes >= self.needed_bytes

    @property
    def shortfall(self) -> int:
        """Bytes still missing after the prune (0 when it fits)."""
        return max(0, self.needed_bytes - self.free_bytes - self.prunable_bytes)

    @property
    def message(self) -> str:
        head = (f"needs {format_bytes(self.needed_bytes)}, {format_bytes(self.free_bytes)} free, "
                f"{format_bytes(self.prunable_bytes)} prunable")
        if self.fits_now:
            return head + ": fits without pruning"
        if self.fits_after_prune:
            return head + ": fits only after pruning old revisions"
        return head + f": {format_bytes(self.shortfall)} short even after pruning"


def free_bytes(path: str) -> int:
    """Free bytes of the filesystem that holds `path`, or would once it is created (its closest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free


def disk_verdict(free_bytes: int, needed_bytes: int, prunable_bytes: int) -> DiskVerdict:
    return DiskVerdict(free_bytes=max(0, free_bytes), needed_bytes=max(0, needed_bytes),
                       prunable_bytes=max(0, prunable_bytes))
