# SPDX-License-Identifier: MIT
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.snapshot_manifest import (
    Manifest,
    ManifestEntry,
    check_snapshot,
    decide_marker,
    load_manifest,
    marker_content,
    save_manifest,
    verify_snapshot,
)

SHA = "a" * 40


def hf_style_snapshot(root: Path, files: dict[str, bytes]) -> Path:
    """A snapshot dir of relative symlinks into ../../blobs, as the Hugging Face cache lays it out."""
    blobs, snap = root / "blobs", root / "snapshots" / SHA
    blobs.mkdir(parents=True)
    for i, (rel, data) in enumerate(files.items()):
        blob = blobs / f"blob{i}"
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def manifest_for(files: dict[str, bytes]) -> Manifest:
    return Manifest("org/model", SHA, tuple(ManifestEntry(p, len(d)) for p, d in sorted(files.items())))


FILES = {"config.json": b"{}", "model.safetensors": b"x" * 100, "sub/tokenizer.json": b"tok"}


def test_complete_snapshot_follows_symlinks_into_blobs(tmp_path):
    snap = hf_style_snapshot(tmp_path, FILES)
    check = check_snapshot(str(snap), manifest_for(FILES).files)
    assert check.complete and check.present_bytes == 105


def test_missing_dangling_and_wrong_size_are_told_apart(tmp_path):
    snap = hf_style_snapshot(tmp_path, FILES)
    os.unlink(tmp_path / "blobs" / "blob0")  # config.json now dangles
    (tmp_path / "blobs" / "blob1").write_bytes(b"x" * 40)  # truncated shard
    (snap / "sub" / "tokenizer.json").unlink()
    check = check_snapshot(str(snap), manifest_for(FILES).files)
    assert not check.complete
    assert sorted(check.missing) == ["config.json", "sub/tokenizer.json"]
    assert check.wrong_size == {"model.safetensors": (100, 40)}
    assert check.bad_paths == ("config.json", "model.safetensors", "sub/tokenizer.json")


def test_a_directory_where_a_file_should_be_is_missing(tmp_path):
    (tmp_path / "config.json").mkdir()
    assert check_snapshot(str(tmp_path), [ManifestEntry("config.json", 2)]).missing == ("config.json",)


def test_manifest_round_trips_and_sorts(tmp_path):
    m = Manifest("org/model", SHA, (ManifestEntry("b", 2), ManifestEntry("a", 1)), ("*.json",), None)
    path = tmp_path / "m" / "manifest.json"
    save_manifest(str(path), m)
    loaded = load_manifest(str(path))
    assert [e.path for e in loaded.files] == ["a", "b"]
    assert loaded.allow_patterns == ("*.json",) and loaded.ignore_patterns is None
    assert json.loads(path.read_text())["total_bytes"] == 3


@pytest.mark.parametrize("content", ["not json", "[]", '{"repo_id": "x"}', '{"repo_id": "x", "revision": "y", "files": [{"path": "a"}]}'])
def test_bad_manifest_is_a_clear_error(tmp_path, content):
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(ValueError):
        load_manifest(str(path))


@pytest.mark.parametrize(
    "complete, present, current, action",
    [
        (True, False, False, "write"),
        (True, True, False, "write"),  # marker of another revision
        (True, True, True, "keep"),
        (False, True, False, "remove"),
        (False, True, True, "remove"),  # never let a marker claim an incomplete copy
        (False, False, False, "keep"),
    ],
)
def test_marker_decision(complete, present, current, action):
    from ansible_collections.sparkops.glm53.plugins.module_utils.snapshot_manifest import SnapshotCheck

    check = SnapshotCheck() if complete else SnapshotCheck(missing=("a",))
    assert decide_marker(check, present, current) == action


def test_verify_writes_marker_once_and_check_mode_writes_nothing(tmp_path):
    snap = hf_style_snapshot(tmp_path, FILES)
    manifest = manifest_for(FILES)
    marker = tmp_path / "marker.json"
    dry = verify_snapshot(str(snap), manifest, str(marker), check_mode=True)
    assert dry.changed and dry.marker_action == "write" and not marker.exists()
    first = verify_snapshot(str(snap), manifest, str(marker), check_mode=False)
    assert first.changed and json.loads(marker.read_text()) == marker_content(manifest)
    second = verify_snapshot(str(snap), manifest, str(marker), check_mode=False)
    assert not second.changed


def test_verify_removes_a_stale_marker_when_a_file_is_gone(tmp_path):
    snap = hf_style_snapshot(tmp_path, FILES)
    manifest = manifest_for(FILES)
    marker = tmp_path / "marker.json"
    verify_snapshot(str(snap), manifest, str(marker), check_mode=False)
    (snap / "config.json").unlink()
    outcome = verify_snapshot(str(snap), manifest, str(marker), check_mode=False)
    assert outcome.marker_action == "remove" and not marker.exists()
    assert outcome.check.missing == ("config.json",)
