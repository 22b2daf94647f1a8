# SPDX-License-Identifier: MIT
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils import hf_snapshot
from ansible_collections.sparkops.glm53.plugins.module_utils.hf_snapshot import (
    ProgressTracker,
    SnapshotError,
    SnapshotRequest,
    SnapshotSource,
    SourceUnavailable,
    candidate_sources,
    ensure_snapshot,
    local_snapshot,
    manifest_path,
    select_files,
    snapshot_dir,
)
from ansible_collections.sparkops.glm53.plugins.module_utils.snapshot_manifest import ManifestEntry, load_manifest

SHA_A = "a" * 40
SHA_B = "b" * 40
FILES = {"config.json": b'{"a": 1}', "model-00001.safetensors": b"w" * 300, "tokenizer.json": b"t" * 20}


class FakeHub:
    """Serves repos from memory and writes the cache the way huggingface_hub does (blob + symlink)."""

    def __init__(self, cache_dir: Path, repos: dict[str, tuple[str, dict[str, bytes]]]) -> None:
        self.cache_dir, self.repos = cache_dir, repos
        self.listed: list[str] = []
        self.downloaded: list[str] = []
        self.broken: set[tuple[str, str]] = set()

    def fetch_manifest(self, source: SnapshotSource):
        self.listed.append(source.repo_id)
        if source.repo_id not in self.repos:
            raise SourceUnavailable(f"{source.repo_id}: RepositoryNotFoundError")
        sha, files = self.repos[source.repo_id]
        if source.revision not in (sha, "main"):
            raise SourceUnavailable(f"{source.repo_id}@{source.revision}: RevisionNotFoundError")
        return sha, [ManifestEntry(p, len(d)) for p, d in files.items()]

    def download(self, repo_id: str, sha: str, path: str) -> None:
        if (repo_id, path) in self.broken:
            raise SourceUnavailable(f"{repo_id}: {path}: 404")
        self.downloaded.append(f"{repo_id}:{path}")
        data = self.repos[repo_id][1][path]
        repo = Path(hf_snapshot.repo_cache_dir(str(self.cache_dir), repo_id))
        blob = repo / "blobs" / f"{repo_id.replace('/', '-')}-{path}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / sha / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


def no_hub():
    raise AssertionError("the hub must not be contacted")


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hub"


def request(cache: Path, **kw) -> SnapshotRequest:
    return SnapshotRequest(repo_id=kw.pop("repo_id", "org/primary"), revision=kw.pop("revision", SHA_A),
                           cache_dir=str(cache), **kw)


def test_candidates_keep_order_each_with_its_own_revision_and_drop_duplicates():
    fallbacks = [SnapshotSource("o/mirror", SHA_B), SnapshotSource("o/other", "v2"), SnapshotSource("o/p", "main")]
    got = candidate_sources("o/p", "main", fallbacks)
    assert got == [SnapshotSource("o/p", "main"), SnapshotSource("o/mirror", SHA_B), SnapshotSource("o/other", "v2")]


def test_a_fallback_is_asked_for_its_own_pin_not_the_primary_sha(cache):
    # The primary is pinned at SHA_A; the mirror only has SHA_B: asked for SHA_A it would not be found.
    hub = FakeHub(cache, {"org/mirror": (SHA_B, FILES)})
    result = ensure_snapshot(request(cache, fallbacks=(SnapshotSource("org/mirror", SHA_B),)), lambda: hub)
    assert (result.repo_id, result.revision) == ("org/mirror", SHA_B)
    assert result.attempts == [{"repo_id": "org/primary", "revision": SHA_A,
                                "error": "org/primary: RepositoryNotFoundError"}]


def test_patterns_select_like_huggingface_hub():
    entries = [ManifestEntry(p, 1) for p in ("a.json", "w/1.safetensors", "w/2.bin", "README.md")]
    assert [e.path for e in select_files(entries, ["*.json", "w/"], ["*.bin"])] == ["a.json", "w/1.safetensors"]
    assert len(select_files(entries, None, None)) == 4


def test_progress_arithmetic_counts_only_this_runs_bytes():
    tracker = ProgressTracker(total_bytes=1000, files_total=4, started_at=100.0, baseline_bytes=200)
    rec = tracker.record(done_bytes=600, files_done=2, now=110.0, wall_time=5.0)
    assert rec["rate_bps"] == 40 and rec["eta_s"] == 10.0
    assert rec == {**rec, "done_bytes": 600, "total_bytes": 1000, "files_done": 2, "files_total": 4, "updated": 5.0}
    assert tracker.record(200, 1, 100.0, 0)["eta_s"] is None  # nothing moved yet: no estimate
    assert tracker.record(5000, 4, 120.0, 0)["done_bytes"] == 1000 and tracker.record(1000, 4, 120.0, 0)["eta_s"] == 0.0


def test_fresh_download_writes_manifest_and_rerun_needs_no_hub(cache):
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES)})
    result = ensure_snapshot(request(cache), lambda: hub)
    assert result.changed and result.repo_id == "org/primary" and result.revision == SHA_A
    assert result.files == 3 and result.total_bytes == result.downloaded_bytes == 328
    assert sorted(result.missing) == sorted(FILES)
    assert load_manifest(result.manifest_path).files == tuple(ManifestEntry(p, len(d)) for p, d in sorted(FILES.items()))
    again = ensure_snapshot(request(cache), no_hub)
    assert not again.changed and again.downloaded_bytes == 0 and again.missing == []


def test_branch_is_resolved_once_then_known_offline(cache):
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES)})
    ensure_snapshot(request(cache, revision="main"), lambda: hub)
    assert (cache / "models--org--primary" / "refs" / "main").read_text() == SHA_A
    assert not ensure_snapshot(request(cache, revision="main"), no_hub).changed


def test_local_snapshot_finds_only_a_complete_one_and_never_with_refresh(cache):
    # The action plugin's foreground run: nothing on disk, a complete snapshot, a damaged one, refresh.
    assert local_snapshot(request(cache)) is None
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES)})
    ensure_snapshot(request(cache), lambda: hub)
    found = local_snapshot(request(cache))
    assert found is not None and (found.repo_id, found.revision, found.changed) == ("org/primary", SHA_A, False)
    assert local_snapshot(request(cache, refresh=True)) is None
    first = sorted(FILES)[0]
    (Path(snapshot_dir(str(cache), "org/primary", SHA_A)) / first).unlink()
    assert local_snapshot(request(cache)) is None


def test_refresh_relists_but_downloads_nothing_present(cache):
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES)})
    ensure_snapshot(request(cache), lambda: hub)
    hub.downloaded.clear()
    result = ensure_snapshot(request(cache, refresh=True), lambda: hub)
    assert not result.changed and hub.downloaded == [] and hub.listed == ["org/primary", "org/primary"]


def test_check_mode_reports_and_writes_nothing(cache):
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES)})
    result = ensure_snapshot(request(cache), lambda: hub, check_mode=True)
    assert result.changed and result.downloaded_bytes == 328 and len(result.missing) == 3
    assert result.disk is not None and result.disk["needed_bytes"] == 328
    assert not cache.exists() and hub.downloaded == []


def test_only_missing_and_wrong_size_files_are_fetched(cache):
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES)})
    ensure_snapshot(request(cache), lambda: hub)
    snap = Path(snapshot_dir(str(cache), "org/primary", SHA_A))
    Path(os.path.realpath(snap / "model-00001.safetensors")).write_bytes(b"w" * 10)  # truncated blob
    (snap / "tokenizer.json").unlink()
    hub.downloaded.clear()
    result = ensure_snapshot(request(cache), lambda: hub)
    assert result.changed and sorted(hub.downloaded) == ["org/primary:model-00001.safetensors", "org/primary:tokenizer.json"]
    assert result.downloaded_bytes == 320 and (snap / "model-00001.safetensors").stat().st_size == 300


def test_missing_primary_falls_back_in_order(cache):
    hub = FakeHub(cache, {"org/second": (SHA_B, FILES)})
    req = request(cache, fallbacks=(SnapshotSource("org/first", SHA_A), SnapshotSource("org/second", SHA_B)))
    result = ensure_snapshot(req, lambda: hub)
    assert result.repo_id == "org/second" and result.revision == SHA_B
    assert hub.listed == ["org/primary", "org/first", "org/second"]
    assert [a["repo_id"] for a in result.attempts] == ["org/primary", "org/first"]
    assert result.snapshot_path == snapshot_dir(str(cache), "org/second", SHA_B)


def test_incomplete_primary_falls_back_and_keeps_its_manifest(cache):
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES), "org/mirror": (SHA_B, FILES)})
    hub.broken.add(("org/primary", "tokenizer.json"))
    result = ensure_snapshot(request(cache, fallbacks=(SnapshotSource("org/mirror", SHA_B),)), lambda: hub)
    assert result.repo_id == "org/mirror" and "404" in result.attempts[0]["error"]
    # The partial primary is not mistaken for complete on the next run.
    assert os.path.exists(manifest_path(str(cache), "org/primary", SHA_A))
    assert ensure_snapshot(request(cache, fallbacks=(SnapshotSource("org/mirror", SHA_B),)), no_hub).repo_id == "org/mirror"


def test_all_candidates_failing_names_every_attempt(cache):
    hub = FakeHub(cache, {})
    with pytest.raises(SnapshotError) as err:
        ensure_snapshot(request(cache, fallbacks=(SnapshotSource("org/x", "main"),)), lambda: hub)
    assert [a["repo_id"] for a in err.value.attempts] == ["org/primary", "org/x"]


def test_a_revision_the_hub_does_not_have_is_named_with_its_repo_before_anything_downloads(cache):
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES)})
    with pytest.raises(SnapshotError) as err:
        ensure_snapshot(request(cache, revision="no-such-tag"), lambda: hub)
    assert str(err.value) == ("no candidate could provide a complete snapshot: "
                              "org/primary@no-such-tag: RevisionNotFoundError")
    assert hub.downloaded == [] and not os.path.exists(manifest_path(str(cache), "org/primary", SHA_A))


@pytest.mark.parametrize("kind", ["RevisionNotFoundError", "RepositoryNotFoundError"])
def test_not_found_says_the_revision_may_be_what_is_missing(kind):
    # olah answers "Repository not found" (401) for an unknown revision of a repo it serves.
    exc = type(kind, (Exception,), {})("401 Client Error: Repository not found")
    error = hf_snapshot.HuggingFaceHub._unavailable(SnapshotSource("sim/tiny-glm", "no-such-tag"), exc)
    assert str(error) == ("sim/tiny-glm@no-such-tag: the hub has no revision 'no-such-tag' of sim/tiny-glm (or no such "
                          "repo, or the token cannot read it); %s: 401 Client Error: Repository not found" % kind)
    other = hf_snapshot.HuggingFaceHub._unavailable(SnapshotSource("a/b", "main"), ConnectionError("refused"))
    assert str(other) == "a/b@main: ConnectionError: refused"


def test_not_enough_disk_fails_before_downloading(cache, monkeypatch):
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES)})
    monkeypatch.setattr(hf_snapshot, "disk_need", lambda d, n: hf_snapshot.DiskNeed(n, n - 1))
    with pytest.raises(SnapshotError, match="needs 328 more bytes"):
        ensure_snapshot(request(cache), lambda: hub)
    assert hub.downloaded == []


def test_disk_need_probes_the_nearest_existing_parent(tmp_path):
    need = hf_snapshot.disk_need(str(tmp_path / "not" / "yet"), 10)
    assert need.needed_bytes == 10 and need.free_bytes > 0 and need.enough


def test_progress_file_ends_done_with_all_bytes(cache, tmp_path):
    hub = FakeHub(cache, {"org/primary": (SHA_A, FILES)})
    progress = tmp_path / "progress.json"
    ensure_snapshot(request(cache, progress_file=str(progress)), lambda: hub)
    rec = json.loads(progress.read_text())
    assert rec["state"] == "done" and rec["done_bytes"] == rec["total_bytes"] == 328
    assert rec["files_done"] == rec["files_total"] == 3 and rec["revision"] == SHA_A


class _Response:
    def __init__(self, status: int) -> None:
        self.status_code = status


class _HttpError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.response = _Response(status)


def test_retries_transient_errors_only():
    calls: list[int] = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert hf_snapshot.with_retries(flaky, sleep=lambda s: None) == "ok" and len(calls) == 3
    assert hf_snapshot.is_transient(_HttpError(503)) and hf_snapshot.is_transient(_HttpError(429))
    assert not hf_snapshot.is_transient(_HttpError(404))

    def not_found():
        calls.append(1)
        raise _HttpError(404)

    calls.clear()
    with pytest.raises(_HttpError):
        hf_snapshot.with_retries(not_found, sleep=lambda s: None)
    assert len(calls) == 1
