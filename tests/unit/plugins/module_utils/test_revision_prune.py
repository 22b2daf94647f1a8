# SPDX-License-Identifier: MIT
"""Pruning old revisions from a real (tmp) Hugging Face cache tree: links into blobs, shared blobs, refs,
our manifests and markers, a worker's regular files, and the disk verdict."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping, Optional

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.cluster import checkpoint_paths
from ansible_collections.sparkops.glm53.plugins.module_utils.hf_snapshot import manifest_path as hf_manifest_path
from ansible_collections.sparkops.glm53.plugins.module_utils.hf_snapshot import snapshot_dir as hf_snapshot_dir
from ansible_collections.sparkops.glm53.plugins.module_utils.revision_prune import (
    PrunePlan,
    RepoScan,
    apply_prune,
    disk_verdict,
    format_bytes,
    free_bytes,
    manifest_path,
    marker_path,
    plan_prune,
    repo_cache_dir,
    scan_repo,
    snapshot_dir,
)

REPO = "org/model"
OLD, MID, NEW = "1" * 40, "2" * 40, "3" * 40
GIB = 1024 ** 3


class Cache:
    """A hub cache dir built file by file, the way huggingface_hub and our modules lay it out."""

    def __init__(self, root: Path, repo_id: str = REPO) -> None:
        self.root = root
        self.repo_id = repo_id
        self.repo = Path(repo_cache_dir(str(root), repo_id))

    def blob(self, name: str, size: int) -> Path:
        path = self.repo / "blobs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        return path

    def link(self, sha: str, rel: str, blob: str, size: Optional[int] = None) -> Path:
        """snapshots/SHA/REL -> ../../blobs/BLOB (relative, as huggingface_hub makes it); the blob is written
        when a size is given."""
        if size is not None:
            self.blob(blob, size)
        link = self.repo / "snapshots" / sha / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(self.repo / "blobs" / blob, link.parent))
        return link

    def regular(self, sha: str, rel: str, size: int) -> Path:
        """A snapshot file that is a plain file (a worker's copy made without keeping links)."""
        path = self.repo / "snapshots" / sha / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"y" * size)
        return path

    def ours(self, sha: str) -> tuple[Path, Path]:
        """Our manifest and marker for a revision."""
        manifest = Path(manifest_path(str(self.root), self.repo_id, sha))
        marker = Path(marker_path(str(self.root), self.repo_id, sha))
        for path in (manifest, marker):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")
        return manifest, marker

    def ref(self, name: str, sha: str) -> Path:
        path = self.repo / "refs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(sha)
        return path

    def scan(self) -> RepoScan:
        return scan_repo(str(self.root), self.repo_id)


def two_revisions(tmp_path: Path) -> Cache:
    """OLD and NEW share config.json's blob; each has its own weights blob."""
    cache = Cache(tmp_path)
    cache.link(OLD, "config.json", "cfg", 10)
    cache.link(OLD, "model.safetensors", "w-old", 1000)
    cache.link(NEW, "config.json", "cfg")
    cache.link(NEW, "model.safetensors", "w-new", 2000)
    return cache


# ---------------------------------------------------------------- paths


def test_manifest_and_marker_paths_are_the_ones_our_other_code_writes(tmp_path: Path) -> None:
    hub = str(tmp_path / "huggingface" / "hub")
    assert manifest_path(hub, REPO, NEW) == hf_manifest_path(hub, REPO, NEW)
    assert manifest_path(hub, REPO, NEW) == f"{hub}/models--org--model/manifests/{NEW}.json"
    # The marker as the sync role names it: checkpoint_paths gives it relative to the HF cache dir.
    root = str(tmp_path / "huggingface")
    paths = checkpoint_paths({"repo_id": REPO, "revision": NEW, "snapshot_path": hf_snapshot_dir(hub, REPO, NEW),
                              "manifest_path": hf_manifest_path(hub, REPO, NEW)}, root)
    assert marker_path(hub, REPO, NEW) == os.path.join(root, paths["marker"])
    assert marker_path(hub, REPO, NEW) == f"{hub}/.glm53-sync/models--org--model@{NEW}.json"
    assert snapshot_dir(hub, REPO, NEW) == os.path.join(root, paths["snapshot"])


# ---------------------------------------------------------------- scanning


def test_scan_resolves_links_to_blob_names_and_sizes(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    cache.link(NEW, "sub/tokenizer.json", "tok", 7)
    scan = cache.scan()
    assert sorted(scan.revisions) == [OLD, NEW]
    assert scan.revisions[OLD].blobs == {"cfg", "w-old"}
    assert scan.revisions[NEW].blobs == {"cfg", "w-new", "tok"}
    assert scan.blob_sizes == {"cfg": 10, "w-old": 1000, "w-new": 2000, "tok": 7}
    assert {f.path for f in scan.revisions[NEW].files} == {"config.json", "model.safetensors",
                                                           os.path.join("sub", "tokenizer.json")}


def test_scan_of_a_missing_repo_or_cache_finds_nothing(tmp_path: Path) -> None:
    scan = scan_repo(str(tmp_path / "absent"), REPO)
    assert scan.revisions == {} and scan.blob_sizes == {} and scan.refs == {}
    assert plan_prune(scan, {NEW}).delete == ()


def test_scan_finds_a_revision_only_our_manifest_or_marker_remembers(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    manifest_only = Path(manifest_path(str(tmp_path), REPO, MID))
    manifest_only.parent.mkdir(parents=True)
    manifest_only.write_text("{}")
    marker_only = "4" * 40
    marker = Path(marker_path(str(tmp_path), REPO, marker_only))
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    # Another repo's marker, whose name starts like ours, is not this repo's.
    other = Path(marker_path(str(tmp_path), REPO + "-x", "5" * 40))
    other.write_text("{}")
    scan = cache.scan()
    assert sorted(scan.revisions) == [OLD, MID, NEW, marker_only]
    assert not scan.revisions[MID].has_snapshot and scan.revisions[MID].files == ()
    plan = plan_prune(scan, {NEW})
    assert plan.revisions == (OLD, MID, marker_only)
    apply_prune(plan)
    assert not manifest_only.exists() and not marker.exists() and other.exists()


def test_stray_entries_are_not_revisions_or_refs(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    (cache.repo / "snapshots" / "README").write_text("not a revision")
    cache.ref("main", NEW)
    (cache.repo / "refs" / "dangling").symlink_to(tmp_path / "nowhere")
    scan = cache.scan()
    assert sorted(scan.revisions) == [OLD, NEW] and scan.refs == {"main": NEW}
    apply_prune(plan_prune(scan, {NEW}))
    assert (cache.repo / "snapshots" / "README").exists()


def test_dangling_link_counts_nothing_and_prunes_cleanly(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    cache.link(OLD, "gone.bin", "never-written")
    plan = plan_prune(cache.scan(), {NEW})
    assert plan.freed_bytes == 1000
    apply_prune(plan)
    assert not (cache.repo / "snapshots" / OLD).exists()


# ---------------------------------------------------------------- planning


def test_a_blob_shared_with_a_kept_revision_is_never_deleted(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    plan = plan_prune(cache.scan(), {NEW})
    assert plan.revisions == (OLD,)
    assert plan.blobs == ("w-old",)  # not "cfg": NEW links to it too
    assert plan.freed_bytes == 1000 and plan.delete[0].bytes == 1000
    apply_prune(plan)
    assert (cache.repo / "blobs" / "cfg").read_bytes() == b"x" * 10
    assert (cache.repo / "snapshots" / NEW / "config.json").read_bytes() == b"x" * 10
    assert not (cache.repo / "blobs" / "w-old").exists()
    assert not (cache.repo / "snapshots" / OLD).exists()
    assert (cache.repo / "snapshots" / NEW / "model.safetensors").stat().st_size == 2000


def test_a_blob_shared_only_by_deleted_revisions_goes_and_counts_once(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    cache.link(MID, "config.json", "cfg")
    cache.link(MID, "model.safetensors", "w-mid", 500)
    plan = plan_prune(cache.scan(), {"9" * 40})  # a kept revision not on disk: everything here goes
    assert plan.revisions == (OLD, MID, NEW) and plan.kept == ()
    assert plan.blobs == ("cfg", "w-mid", "w-new", "w-old")
    # cfg counts for the first pruned revision only, so the per-revision bytes add up to freed_bytes.
    assert [r.bytes for r in plan.delete] == [1010, 500, 2000]
    assert plan.freed_bytes == 3510
    apply_prune(plan)
    assert sorted(os.listdir(cache.repo / "blobs")) == [] and os.listdir(cache.repo / "snapshots") == []


def test_a_kept_revision_is_never_deleted_whatever_else_is_asked(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    cache.link(MID, "model.safetensors", "w-mid", 500)
    plan = plan_prune(cache.scan(), [OLD, NEW, OLD, "f" * 40])  # duplicates and an absent revision are fine
    assert plan.revisions == (MID,) and plan.kept == (OLD, NEW)
    apply_prune(plan)
    assert sorted(os.listdir(cache.repo / "snapshots")) == [OLD, NEW]
    assert (cache.repo / "blobs" / "w-old").exists() and (cache.repo / "blobs" / "w-new").exists()


def test_keeping_every_revision_plans_nothing(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    plan = plan_prune(cache.scan(), {OLD, NEW})
    assert not plan.changed and plan.delete == () and plan.blobs == () and plan.freed_bytes == 0


def test_a_snapshot_dir_that_is_not_a_commit_sha_stays_and_protects_its_blobs(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    cache.link("not-a-sha", "model.safetensors", "w-old")
    plan = plan_prune(cache.scan(), {NEW})
    assert plan.revisions == (OLD,) and "not-a-sha" in plan.kept
    assert plan.blobs == () and plan.freed_bytes == 0


def test_incomplete_blobs_are_never_touched(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    partial = cache.blob("w-next.incomplete", 300)
    # Even a (broken) link to a partial blob does not make it a blob of the revision.
    cache.link(OLD, "half.safetensors", "w-next.incomplete")
    unreferenced = cache.blob("orphan", 50)
    plan = plan_prune(cache.scan(), {NEW})
    assert "w-next.incomplete" not in plan.blobs and plan.freed_bytes == 1000
    apply_prune(plan)
    assert partial.read_bytes() == b"x" * 300 and unreferenced.exists()


def test_apply_never_removes_an_incomplete_blob_even_when_a_plan_names_it(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    partial = cache.blob("w.incomplete", 30)
    plan = plan_prune(cache.scan(), {NEW})
    apply_prune(PrunePlan(plan.scan, plan.delete, plan.kept, plan.blobs + ("w.incomplete",), plan.refs))
    assert partial.exists() and not (cache.repo / "blobs" / "w-old").exists()


# ---------------------------------------------------------------- a worker's regular files


def test_regular_snapshot_files_count_their_own_size(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    cache.regular(OLD, "config.json", 10)
    cache.regular(OLD, "sub/model.safetensors", 1000)
    cache.regular(NEW, "config.json", 10)
    scan = cache.scan()
    assert scan.revisions[OLD].blobs == frozenset() and scan.revisions[OLD].own_bytes == 1010
    plan = plan_prune(scan, {NEW})
    assert plan.freed_bytes == 1010 and plan.blobs == ()
    apply_prune(plan)
    assert os.listdir(cache.repo / "snapshots") == [NEW]


def test_mixed_links_and_regular_files(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    cache.regular(OLD, "extra.bin", 64)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"z" * 4096)
    (cache.repo / "snapshots" / OLD / "outside.bin").symlink_to(outside)  # a link out of blobs/ frees nothing
    plan = plan_prune(cache.scan(), {NEW})
    assert plan.freed_bytes == 1000 + 64
    apply_prune(plan)
    assert outside.exists()


# ---------------------------------------------------------------- applying: our files and refs


def test_pruning_removes_our_manifest_and_marker_of_pruned_revisions_only(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    old_manifest, old_marker = cache.ours(OLD)
    new_manifest, new_marker = cache.ours(NEW)
    apply_prune(plan_prune(cache.scan(), {NEW}))
    assert not old_manifest.exists() and not old_marker.exists()
    assert new_manifest.exists() and new_marker.exists()


def test_refs_naming_a_pruned_revision_are_removed(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    main = cache.ref("main", NEW)
    stale = cache.ref("v1", OLD)
    pr = cache.ref("pr/1", OLD)
    scan = cache.scan()
    assert scan.refs == {"main": NEW, "v1": OLD, os.path.join("pr", "1"): OLD}
    plan = plan_prune(scan, {NEW})
    assert set(plan.refs) == {"v1", os.path.join("pr", "1")}
    apply_prune(plan)
    assert main.read_text() == NEW and not stale.exists() and not pr.exists()


def test_no_exist_dir_of_a_pruned_revision_goes(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    for sha in (OLD, NEW):
        (cache.repo / ".no_exist" / sha).mkdir(parents=True)
    apply_prune(plan_prune(cache.scan(), {NEW}))
    assert os.listdir(cache.repo / ".no_exist") == [NEW]


def test_a_prune_interrupted_while_removing_blobs_is_finished_by_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = two_revisions(tmp_path)
    manifest, marker = cache.ours(OLD)
    unlink = os.unlink

    def dies_on_blobs(path: str) -> None:
        if os.path.dirname(path).endswith("blobs"):
            raise OSError("interrupted")
        unlink(path)

    monkeypatch.setattr(os, "unlink", dies_on_blobs)
    with pytest.raises(OSError):
        apply_prune(plan_prune(cache.scan(), {NEW}))
    monkeypatch.setattr(os, "unlink", unlink)
    assert not marker.exists()  # nothing vouches for the revision being removed
    # The snapshot still links to the blob, so the next run finds both and frees it.
    again = plan_prune(cache.scan(), {NEW})
    assert again.revisions == (OLD,) and again.freed_bytes == 1000
    apply_prune(again)
    assert not (cache.repo / "blobs" / "w-old").exists() and not manifest.exists()


def test_a_second_prune_finds_nothing(tmp_path: Path) -> None:
    cache = two_revisions(tmp_path)
    cache.ours(OLD)
    apply_prune(plan_prune(cache.scan(), {NEW}))
    again = plan_prune(cache.scan(), {NEW})
    assert not again.changed and again.kept == (NEW,)


# ---------------------------------------------------------------- disk verdict


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 * 1024 ** 2, "5.0 MiB"),
    (164 * GIB, "164.0 GiB"), (2 * 1024 ** 4, "2.0 TiB"), (3 * 1024 ** 6, "3072.0 PiB"),
])
def test_format_bytes_uses_binary_units(n: int, text: str) -> None:
    assert format_bytes(n) == text


VERDICTS: Mapping[str, tuple[tuple[int, int, int], bool, bool, int, str]] = {
    "fits now": ((200 * GIB, 164 * GIB, 50 * GIB), True, True, 0,
                 "needs 164.0 GiB, 200.0 GiB free, 50.0 GiB prunable: fits without pruning"),
    "fits exactly": ((164 * GIB, 164 * GIB, 0), True, True, 0,
                     "needs 164.0 GiB, 164.0 GiB free, 0 B prunable: fits without pruning"),
    "fits after prune": ((100 * GIB, 164 * GIB, 80 * GIB), False, True, 0,
                         "needs 164.0 GiB, 100.0 GiB free, 80.0 GiB prunable: fits only after pruning old revisions"),
    "short": ((100 * GIB, 164 * GIB, 40 * GIB), False, False, 24 * GIB,
              "needs 164.0 GiB, 100.0 GiB free, 40.0 GiB prunable: 24.0 GiB short even after pruning"),
}


@pytest.mark.parametrize("case", sorted(VERDICTS))
def test_disk_verdict(case: str) -> None:
    (free, needed, prunable), now, after, shortfall, message = VERDICTS[case]
    verdict = disk_verdict(free_bytes=free, needed_bytes=needed, prunable_bytes=prunable)
    assert (verdict.fits_now, verdict.fits_after_prune, verdict.shortfall) == (now, after, shortfall)
    assert verdict.message == message


def test_disk_verdict_nothing_needed_fits_even_on_a_full_disk() -> None:
    verdict = disk_verdict(free_bytes=0, needed_bytes=0, prunable_bytes=0)
    assert verdict.fits_now and verdict.shortfall == 0


def test_free_bytes_of_a_path_not_made_yet_is_its_closest_parents(tmp_path: Path) -> None:
    assert abs(free_bytes(str(tmp_path / "not" / "yet")) - shutil.disk_usage(tmp_path).free) < 64 * 1024 * 1024
