# -*- coding: utf-8 -*-
# SPDX-License-Identifier: MIT
"""Download a pinned model revision into a Hugging Face cache, completely and resumably (per file).

Complete means every file of the revision (after allow/ignore patterns) is in the snapshot directory
with the size the hub lists. The hub is asked once for the file list with sizes (the manifest); only
files that are absent or of the wrong size are fetched, so a re-run costs one stat per file. A manifest
JSON is written beside the snapshot (models--ORG--REPO/manifests/SHA.json) for workers to verify their
rsynced copy without the hub, and lets a re-run with a pinned sha skip the hub altogether.

huggingface_hub is imported only inside HuggingFaceHub, so the planning logic is testable without it.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from ansible_collections.sparkops.glm53.plugins.module_utils.snapshot_manifest import (
    Manifest,
    ManifestEntry,
    SnapshotCheck,
    check_snapshot,
    load_manifest,
    save_manifest,
    write_json_atomic,
)

_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
PROGRESS_INTERVAL_S = 2.0


class SourceUnavailable(Exception):
    """A candidate repo/revision cannot be listed or fully downloaded; the next candidate is tried."""


class SnapshotError(Exception):
    def __init__(self, msg: str, attempts: Sequence[dict[str, str]]) -> None:
        super().__init__(msg)
        self.attempts = list(attempts)


# ---------------------------------------------------------------- candidates and cache layout


@dataclass(frozen=True)
class SnapshotSource:
    repo_id: str
    revision: str


def candidate_sources(repo_id: str, revision: str, fallbacks: Sequence[SnapshotSource] = ()) -> list[SnapshotSource]:
    """The primary first, then the fallbacks in the order given, each with its own revision: a commit sha
    belongs to one repo, so a mirror's pin never applies to the repo it mirrors. Duplicates are dropped."""
    unique: list[SnapshotSource] = []
    for source in [SnapshotSource(repo_id, revision), *fallbacks]:
        if source not in unique:
            unique.append(source)
    return unique


def is_commit_sha(revision: str) -> bool:
    return bool(_SHA_RE.match(revision))


def repo_cache_dir(cache_dir: str, repo_id: str) -> str:
    return os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))


def snapshot_dir(cache_dir: str, repo_id: str, sha: str) -> str:
    return os.path.join(repo_cache_dir(cache_dir, repo_id), "snapshots", sha)


def manifest_path(cache_dir: str, repo_id: str, sha: str) -> str:
    return os.path.join(repo_cache_dir(cache_dir, repo_id), "manifests", sha + ".json")


def local_commit(cache_dir: str, source: SnapshotSource) -> Optional[str]:
    """The sha a revision resolved to last time (refs/NAME, as huggingface_hub keeps it), if known."""
    if is_commit_sha(source.revision):
        return source.revision
    try:
        with open(os.path.join(repo_cache_dir(cache_dir, source.repo_id), "refs", source.revision)) as handle:
            sha = handle.read().strip()
    except OSError:
        return None
    return sha if is_commit_sha(sha) else None


def record_ref(cache_dir: str, source: SnapshotSource, sha: str) -> None:
    if is_commit_sha(source.revision):
        return
    path = os.path.join(repo_cache_dir(cache_dir, source.repo_id), "refs", source.revision)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(sha)


# ---------------------------------------------------------------- patterns and planning


def _normalize_pattern(pattern: str) -> str:
    # As huggingface_hub does: "dir/" means everything below dir.
    return pattern + "*" if pattern.endswith("/") else pattern


def select_files(
    paths: Sequence[ManifestEntry],
    allow_patterns: Optional[Sequence[str]],
    ignore_patterns: Optional[Sequence[str]],
) -> tuple[ManifestEntry, ...]:
    allow = [_normalize_pattern(p) for p in allow_patterns] if allow_patterns else None
    ignore = [_normalize_pattern(p) for p in ignore_patterns] if ignore_patterns else []
    chosen = [
        entry
        for entry in paths
        if (allow is None or any(fnmatch.fnmatch(entry.path, p) for p in allow))
        and not any(fnmatch.fnmatch(entry.path, p) for p in ignore)
    ]
    return tuple(sorted(chosen, key=lambda e: e.path))


@dataclass(frozen=True)
class DownloadPlan:
    manifest: Manifest
    check: SnapshotCheck

    @property
    def to_fetch(self) -> tuple[ManifestEntry, ...]:
        bad = set(self.check.bad_paths)
        return tuple(e for e in self.manifest.files if e.path in bad)

    @property
    def fetch_bytes(self) -> int:
        return sum(e.size for e in self.to_fetch)


def plan_download(manifest: Manifest, snapshot_path: str) -> DownloadPlan:
    return DownloadPlan(manifest, check_snapshot(snapshot_path, manifest.files))


def discard_bad_copy(snapshot_path: str, rel_path: str) -> None:
    """Remove a wrong-size file and the blob it points to: huggingface_hub trusts an existing snapshot
    link and would never fetch that file again. Partial `.incomplete` blobs are kept (they resume)."""
    link = os.path.join(snapshot_path, rel_path)
    if os.path.islink(link):
        blob = os.path.realpath(link)
        os.unlink(link)
        if os.path.isfile(blob):
            os.unlink(blob)
    elif os.path.lexists(link):
        os.unlink(link)


# ---------------------------------------------------------------- disk and progress


@dataclass(frozen=True)
class DiskNeed:
    needed_bytes: int
    free_bytes: int

    @property
    def enough(self) -> bool:
        return self.free_bytes >= self.needed_bytes


def disk_need(cache_dir: str, needed_bytes: int) -> DiskNeed:
    """Free space where cache_dir is (or would be created): the nearest existing ancestor counts."""
    probe = os.path.abspath(cache_dir)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return DiskNeed(needed_bytes=needed_bytes, free_bytes=shutil.disk_usage(probe).free)


@dataclass
class ProgressTracker:
    """Turns byte counts into the progress record a controller-side poller prints."""

    total_bytes: int
    files_total: int
    started_at: float
    # Bytes already present when this run started do not count toward the rate.
    baseline_bytes: int = 0

    def record(self, done_bytes: int, files_done: int, now: float, wall_time: float) -> dict[str, Any]:
        done = min(done_bytes, self.total_bytes)
        elapsed = max(now - self.started_at, 1e-9)
        rate = max(done - self.baseline_bytes, 0) / elapsed
        remaining = self.total_bytes - done
        eta: Optional[float]
        if remaining <= 0:
            eta = 0.0
        elif rate > 0:
            eta = round(remaining / rate, 1)
        else:
            eta = None
        return {
            "done_bytes": done,
            "total_bytes": self.total_bytes,
            "files_done": files_done,
            "files_total": self.files_total,
            "rate_bps": round(rate),
            "eta_s": eta,
            "updated": round(wall_time, 3),
        }


def _incomplete_blobs(cache_dir: str, repo_id: str) -> list[tuple[str, int]]:
    """(path, size) of huggingface_hub's `.incomplete` blobs of this repo; vanished files are skipped."""
    blobs = os.path.join(repo_cache_dir(cache_dir, repo_id), "blobs")
    try:
        names = os.listdir(blobs)
    except OSError:
        return []
    found = []
    for name in names:
        if name.endswith(".incomplete"):
            path = os.path.join(blobs, name)
            try:
                found.append((path, os.stat(path).st_size))
            except OSError:
                pass
    return found


def remove_stale_partials(cache_dir: str, repo_id: str) -> int:
    """Delete `.incomplete` blobs left by a killed run; returns bytes freed.

    huggingface_hub >= 1.x downloads into a per-process `<etag>.<random>.incomplete` file and never
    resumes another process's partial file, so leftovers only waste disk (up to a shard per stream)
    and would inflate the progress count. Resumption is per file: finished files are never fetched again.
    """
    freed = 0
    for path, size in _incomplete_blobs(cache_dir, repo_id):
        try:
            os.unlink(path)
            freed += size
        except OSError:
            pass
    return freed


def partial_bytes(cache_dir: str, repo_id: str) -> int:
    """Bytes in huggingface_hub's in-flight `.incomplete` blobs of this repo."""
    return sum(size for _blob, size in _incomplete_blobs(cache_dir, repo_id))


# ---------------------------------------------------------------- the hub


class Hub(Protocol):
    def fetch_manifest(self, source: SnapshotSource) -> tuple[str, list[ManifestEntry]]:
        """(resolved commit sha, every file of that commit with its size)."""

    def download(self, repo_id: str, sha: str, path: str) -> None:
        """Fetch one file of commit `sha` into the cache (resumes a partial blob)."""


def is_transient(exc: BaseException) -> bool:
    """Worth another try: connection trouble, 429 or 5xx. Seen with olah: a 500 (its answer to an unknown
    sha) drops the connection, and the next request on a pooled keep-alive connection gets ECONNRESET."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(status, int):
        return status == 429 or status >= 500
    # huggingface_hub 2.x talks through `httpx2`, 1.x through `httpx`: their transport errors carry no response.
    return isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__module__.startswith("httpx")


def not_found_hint(source: SnapshotSource, exc: BaseException) -> str:
    """What a not-found answer means for a pinned revision. The hub says "repository not found" (olah
    answers 401) also when only the revision is missing, which sends users looking at the repo name."""
    if type(exc).__name__ not in ("RevisionNotFoundError", "RepositoryNotFoundError"):
        return ""
    return (f"the hub has no revision {source.revision!r} of {source.repo_id} (or no such repo, or the token "
            "cannot read it); ")


def with_retries(call: Callable[[], Any], tries: int = 4, delay_s: float = 0.5,
                 sleep: Callable[[float], None] = time.sleep,
                 before_retry: Callable[[], None] = lambda: None) -> Any:
    for attempt in range(1, tries + 1):
        try:
            return call()
        except Exception as exc:
            if attempt == tries or not is_transient(exc):
                raise
            before_retry()
            sleep(delay_s * attempt)
    raise AssertionError("unreachable")


class HuggingFaceHub:
    """The real hub (or a compatible endpoint such as olah) through huggingface_hub."""

    def __init__(self, cache_dir: str, endpoint: Optional[str] = None, token: Optional[str] = None) -> None:
        from huggingface_hub import HfApi
        from huggingface_hub.utils import disable_progress_bars

        # Progress bars would go to the module's stderr; progress_file is the channel instead.
        disable_progress_bars()
        self.cache_dir = cache_dir
        self.endpoint = endpoint
        self.token = token
        self.api = HfApi(endpoint=endpoint, token=token)

    @staticmethod
    def _unavailable(source: SnapshotSource, exc: Exception) -> SourceUnavailable:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return SourceUnavailable(f"{source.repo_id}@{source.revision}: {not_found_hint(source, exc)}"
                                 f"{type(exc).__name__}: {first_line}")

    @staticmethod
    def _fresh_connections() -> None:
        # huggingface_hub shares one client; its pool may hold connections the server already dropped.
        from huggingface_hub.utils import close_session

        close_session()

    def fetch_manifest(self, source: SnapshotSource) -> tuple[str, list[ManifestEntry]]:
        from huggingface_hub.hf_api import RepoFile

        try:
            # olah answers model_info only with an explicit revision; its `siblings` carry no sizes, so
            # sizes come from the tree listing of the resolved commit (real hub: LFS sizes, not pointers).
            sha = with_retries(lambda: self.api.model_info(source.repo_id, revision=source.revision).sha,
                               before_retry=self._fresh_connections)
            if not sha:
                raise SourceUnavailable(f"{source.repo_id}@{source.revision}: hub returned no commit sha")
            tree = with_retries(lambda: list(self.api.list_repo_tree(source.repo_id, revision=sha, recursive=True)),
                                before_retry=self._fresh_connections)
            files = [ManifestEntry(item.path, int(item.size)) for item in tree if isinstance(item, RepoFile)]
        except SourceUnavailable:
            raise
        except Exception as exc:  # HTTP, connection and repo/revision-not-found errors alike
            raise self._unavailable(source, exc) from exc
        if not files:
            raise SourceUnavailable(f"{source.repo_id}@{sha}: the revision lists no files")
        return sha, files

    def download(self, repo_id: str, sha: str, path: str) -> None:
        from huggingface_hub import hf_hub_download

        try:
            with_retries(lambda: hf_hub_download(
                repo_id, path, revision=sha, cache_dir=self.cache_dir, endpoint=self.endpoint, token=self.token
            ))
        except Exception as exc:
            raise self._unavailable(SnapshotSource(repo_id, sha), exc) from exc


# ---------------------------------------------------------------- the whole job


@dataclass(frozen=True)
class SnapshotRequest:
    repo_id: str
    revision: str
    cache_dir: str
    fallbacks: tuple[SnapshotSource, ...] = ()
    allow_patterns: Optional[tuple[str, ...]] = None
    ignore_patterns: Optional[tuple[str, ...]] = None
    refresh: bool = False
    progress_file: Optional[str] = None
    max_workers: int = 4


@dataclass
class SnapshotResult:
    repo_id: str
    revision: str
    snapshot_path: str
    manifest_path: str
    files: int
    total_bytes: int
    downloaded_bytes: int
    missing: list[str]
    changed: bool
    attempts: list[dict[str, str]] = field(default_factory=list)
    disk: Optional[dict[str, int]] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "snapshot_path": self.snapshot_path,
            "manifest_path": self.manifest_path,
            "files": self.files,
            "total_bytes": self.total_bytes,
            "downloaded_bytes": self.downloaded_bytes,
            "missing": self.missing,
            "attempts": self.attempts,
            "disk": self.disk,
        }


def _result(req: SnapshotRequest, plan: DownloadPlan, changed: bool, downloaded: int, **extra: Any) -> SnapshotResult:
    m = plan.manifest
    return SnapshotResult(
        repo_id=m.repo_id,
        revision=m.revision,
        snapshot_path=snapshot_dir(req.cache_dir, m.repo_id, m.revision),
        manifest_path=manifest_path(req.cache_dir, m.repo_id, m.revision),
        files=len(m.files),
        total_bytes=m.total_bytes,
        downloaded_bytes=downloaded,
        missing=list(plan.check.bad_paths),
        changed=changed,
        **extra,
    )


def complete_local_snapshot(req: SnapshotRequest, source: SnapshotSource) -> Optional[DownloadPlan]:
    """A complete snapshot known from an earlier run's manifest, found without asking the hub."""
    sha = local_commit(req.cache_dir, source)
    if sha is None:
        return None
    try:
        manifest = load_manifest(manifest_path(req.cache_dir, source.repo_id, sha))
    except ValueError:
        return None
    if (manifest.allow_patterns, manifest.ignore_patterns) != (req.allow_patterns, req.ignore_patterns):
        return None
    plan = plan_download(manifest, snapshot_dir(req.cache_dir, source.repo_id, sha))
    return plan if plan.check.complete else None


def _write_progress(req: SnapshotRequest, tracker: ProgressTracker, plan: DownloadPlan, files_done: int,
                    done_bytes: int, clock: Callable[[], float], state: str) -> None:
    if not req.progress_file:
        return
    record = tracker.record(done_bytes, files_done, clock(), time.time())
    record.update({"repo_id": plan.manifest.repo_id, "revision": plan.manifest.revision, "state": state})
    write_json_atomic(req.progress_file, record)


def download_missing(req: SnapshotRequest, hub: Hub, plan: DownloadPlan,
                     clock: Callable[[], float] = time.monotonic) -> int:
    """Fetch plan.to_fetch with a few parallel streams, writing progress every PROGRESS_INTERVAL_S."""
    manifest = plan.manifest
    snap = snapshot_dir(req.cache_dir, manifest.repo_id, manifest.revision)
    for rel in plan.check.wrong_size:
        discard_bad_copy(snap, rel)
    remove_stale_partials(req.cache_dir, manifest.repo_id)
    todo = plan.to_fetch
    tracker = ProgressTracker(manifest.total_bytes, len(manifest.files), clock(), plan.check.present_bytes)
    done_bytes = plan.check.present_bytes
    files_done = len(manifest.files) - len(todo)
    _write_progress(req, tracker, plan, files_done, done_bytes, clock, "downloading")
    errors: list[str] = []
    with ThreadPoolExecutor(max_workers=max(1, req.max_workers)) as pool:
        pending: dict[Future[None], ManifestEntry] = {
            pool.submit(hub.download, manifest.repo_id, manifest.revision, e.path): e for e in todo
        }
        while pending:
            finished, _running = wait(list(pending), timeout=PROGRESS_INTERVAL_S, return_when=FIRST_COMPLETED)
            for future in finished:
                entry = pending.pop(future)
                exc = future.exception()
                if exc is not None:
                    errors.append(str(exc))
                else:
                    done_bytes += entry.size
                    files_done += 1
            in_flight = partial_bytes(req.cache_dir, manifest.repo_id)
            _write_progress(req, tracker, plan, files_done, done_bytes + in_flight, clock, "downloading")
    if errors:
        raise SourceUnavailable("; ".join(errors[:3]) + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""))
    _write_progress(req, tracker, plan, files_done, done_bytes, clock, "done")
    return sum(e.size for e in todo)


def local_snapshot(req: SnapshotRequest) -> Optional[SnapshotResult]:
    """The first candidate already complete on disk by an earlier run's manifest (None with refresh)."""
    if req.refresh:
        return None
    for source in candidate_sources(req.repo_id, req.revision, req.fallbacks):
        plan = complete_local_snapshot(req, source)
        if plan is not None:
            return _result(req, plan, changed=False, downloaded=0)
    return None


def ensure_snapshot(req: SnapshotRequest, hub_factory: Callable[[], Hub], check_mode: bool = False,
                    clock: Callable[[], float] = time.monotonic) -> SnapshotResult:
    """Make one candidate's snapshot complete (or, in check mode, say what that would take)."""
    found = local_snapshot(req)
    if found is not None:
        return found

    sources = candidate_sources(req.repo_id, req.revision, req.fallbacks)
    hub = hub_factory()
    attempts: list[dict[str, str]] = []
    for source in sources:
        try:
            sha, listed = hub.fetch_manifest(source)
            manifest = Manifest(source.repo_id, sha, select_files(listed, req.allow_patterns, req.ignore_patterns),
                                req.allow_patterns, req.ignore_patterns)
            if not manifest.files:
                raise SourceUnavailable(f"{source.repo_id}@{sha}: no file matches the allow/ignore patterns")
            snap = snapshot_dir(req.cache_dir, source.repo_id, sha)
            plan = plan_download(manifest, snap)
            disk = disk_need(req.cache_dir, plan.fetch_bytes)
            disk_info = {"needed_bytes": disk.needed_bytes, "free_bytes": disk.free_bytes}
            if check_mode:
                return _result(req, plan, changed=not plan.check.complete, downloaded=plan.fetch_bytes,
                               attempts=attempts, disk=disk_info)
            if not disk.enough:
                raise SnapshotError(
                    f"{source.repo_id}@{sha} needs {disk.needed_bytes} more bytes in {req.cache_dir}, "
                    f"{disk.free_bytes} free", attempts)
            # The manifest goes down first: workers and re-runs can then tell a partial copy from a full one.
            save_manifest(manifest_path(req.cache_dir, source.repo_id, sha), manifest)
            record_ref(req.cache_dir, source, sha)
            downloaded = download_missing(req, hub, plan, clock) if plan.to_fetch else 0
            after = plan_download(manifest, snap)
            if not after.check.complete:
                raise SourceUnavailable(
                    f"{source.repo_id}@{sha}: still incomplete after download: {list(after.check.bad_paths)[:5]}")
            return _result(req, plan, changed=bool(plan.to_fetch), downloaded=downloaded,
                           attempts=attempts, disk=disk_info)
        except SourceUnavailable as exc:
            attempts.append({"repo_id": source.repo_id, "revision": source.revision, "error": str(exc)})
    # Each attempt's error starts with its repo@revision: the message says which revision failed and why.
    raise SnapshotError("no candidate could provide a complete snapshot: "
                        + "; ".join(a["error"] for a in attempts), attempts)
