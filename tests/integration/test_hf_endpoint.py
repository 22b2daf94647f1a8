# SPDX-License-Identifier: MIT
"""hf_snapshot and snapshot_verify against a real olah endpoint serving a tiny model made here."""
from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.hf_snapshot import (
    HuggingFaceHub,
    SnapshotRequest,
    SnapshotSource,
    SnapshotError,
    ensure_snapshot,
    repo_cache_dir,
)

from tools.sim_model.hub_repos import publish_model
from tools.sim_model.make_tiny_glm import write_checkpoint
from tools.sim_model.serve_hub import HubLayout, free_port, olah_config, running_hub

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]

PRIMARY, MIRROR = "sim/tiny-glm", "mirror/tiny-glm"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    model = write_checkpoint(root / "model", seed=0)
    layout = HubLayout(root / "olah", "127.0.0.1", free_port())
    shas = {
        PRIMARY: publish_model(model, layout.mirrors_dir, PRIMARY),
        # Another commit message gives the mirror its own sha, as a real mirror repo has.
        MIRROR: publish_model(model, layout.mirrors_dir, MIRROR, message="mirror upload"),
    }
    layout.config_path.write_text(olah_config(layout))
    with running_hub(layout):
        yield {"endpoint": layout.endpoint, "shas": shas, "model": model}


def request(hub, cache: Path, **kw) -> SnapshotRequest:
    kw.setdefault("revision", hub["shas"][PRIMARY])
    return SnapshotRequest(repo_id=kw.pop("repo_id", PRIMARY), cache_dir=str(cache), **kw)


def factory(hub, cache: Path):
    return lambda: HuggingFaceHub(str(cache), endpoint=hub["endpoint"])


def ensure(req: SnapshotRequest, hub_factory, **kw):
    """ensure_snapshot, failing with every candidate's error (the evidence) instead of a bare message."""
    try:
        return ensure_snapshot(req, hub_factory, **kw)
    except SnapshotError as exc:
        pytest.fail(f"{exc}: {exc.attempts}")


def assert_identical(snapshot: str, model: Path) -> None:
    names = sorted(p.name for p in model.iterdir())
    assert sorted(os.listdir(snapshot)) == names
    match, mismatch, errors = filecmp.cmpfiles(snapshot, model, names, shallow=False)
    assert (mismatch, errors) == ([], [])


def test_plain_snapshot_download_is_byte_identical(hub, tmp_path):
    from huggingface_hub import snapshot_download

    path = snapshot_download(PRIMARY, revision=hub["shas"][PRIMARY], endpoint=hub["endpoint"], cache_dir=str(tmp_path))
    assert_identical(path, hub["model"])


def test_manifest_lists_every_file_with_its_size(hub, tmp_path):
    sha, files = HuggingFaceHub(str(tmp_path), endpoint=hub["endpoint"]).fetch_manifest(SnapshotSource(PRIMARY, "main"))
    assert sha == hub["shas"][PRIMARY]
    assert {f.path: f.size for f in files} == {p.name: p.stat().st_size for p in hub["model"].iterdir()}


def test_download_then_rerun_is_unchanged_and_offline(hub, tmp_path):
    progress = tmp_path / "progress.json"
    first = ensure(request(hub, tmp_path, revision="main", progress_file=str(progress)), factory(hub, tmp_path))
    assert first.changed and first.revision == hub["shas"][PRIMARY]
    assert first.downloaded_bytes == first.total_bytes > 2_000_000
    assert_identical(first.snapshot_path, hub["model"])
    record = json.loads(progress.read_text())
    assert record["state"] == "done" and record["done_bytes"] == first.total_bytes

    def unreachable():
        return HuggingFaceHub(str(tmp_path), endpoint="http://127.0.0.1:9")

    again = ensure(request(hub, tmp_path, revision="main"), unreachable)
    assert not again.changed and again.snapshot_path == first.snapshot_path
    relisted = ensure(request(hub, tmp_path, refresh=True), factory(hub, tmp_path), check_mode=True)
    assert not relisted.changed and relisted.missing == []


def test_resume_after_truncated_and_interrupted_files(hub, tmp_path):
    first = ensure(request(hub, tmp_path), factory(hub, tmp_path))
    snap = Path(first.snapshot_path)
    weights = Path(os.path.realpath(snap / "model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])  # a shard cut short
    tokenizer_blob = Path(os.path.realpath(snap / "tokenizer.json"))
    partial = tokenizer_blob.read_bytes()[:5000]
    (snap / "tokenizer.json").unlink()
    tokenizer_blob.unlink()
    # What a killed huggingface_hub download leaves behind; hf_hub 2.x never resumes it (per-process
    # temp names), and olah ignores Range anyway, so the file is fetched again whole.
    Path(str(tokenizer_blob) + ".0badf00d.incomplete").write_bytes(partial)

    dry = ensure(request(hub, tmp_path), factory(hub, tmp_path), check_mode=True)
    assert dry.changed and sorted(dry.missing) == ["model.safetensors", "tokenizer.json"]
    assert weights.stat().st_size == 1000  # check mode touched nothing

    fixed = ensure(request(hub, tmp_path), factory(hub, tmp_path))
    assert fixed.changed and sorted(fixed.missing) == ["model.safetensors", "tokenizer.json"]
    assert_identical(fixed.snapshot_path, hub["model"])
    assert not list((Path(repo_cache_dir(str(tmp_path), PRIMARY)) / "blobs").glob("*.incomplete"))


def test_missing_primary_falls_back_to_the_pinned_mirror(hub, tmp_path):
    mirror_sha = hub["shas"][MIRROR]
    result = ensure(
        request(hub, tmp_path, repo_id="sim/absent", fallbacks=(SnapshotSource(MIRROR, mirror_sha),)),
        factory(hub, tmp_path),
    )
    assert result.repo_id == MIRROR and result.revision == mirror_sha
    assert result.attempts[0]["repo_id"] == "sim/absent"
    assert_identical(result.snapshot_path, hub["model"])


def test_unknown_primary_revision_falls_back(hub, tmp_path):
    result = ensure(
        request(hub, tmp_path, revision="0" * 40, fallbacks=(SnapshotSource(MIRROR, hub["shas"][MIRROR]),)),
        factory(hub, tmp_path),
    )
    assert result.repo_id == MIRROR and "0" * 40 in result.attempts[0]["error"]


def run_module(name: str, args: dict, tmp_path: Path) -> dict:
    """Run a module file the way Ansible does on a node: an args file and JSON on stdout."""
    args_file = tmp_path / f"{name}-args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / ".collections")}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "plugins" / "modules" / f"{name}.py"), str(args_file)],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    return json.loads(done.stdout)


def test_modules_download_rsync_copy_and_verify(hub, tmp_path):
    head, worker = tmp_path / "head", tmp_path / "worker"
    args = {"repo_id": PRIMARY, "revision": "main", "cache_dir": str(head), "endpoint": hub["endpoint"],
            "token": "hf_secret_token", "_ansible_check_mode": True}
    files = sum(1 for f in hub["model"].iterdir() if f.is_file())
    dry = run_module("hf_snapshot", args, tmp_path)
    assert dry["changed"] and len(dry["missing"]) == files and not head.exists()
    got = run_module("hf_snapshot", {**args, "_ansible_check_mode": False}, tmp_path)
    assert got["changed"] and got["files"] == files and "hf_secret_token" not in json.dumps(got)
    assert not run_module("hf_snapshot", {**args, "_ansible_check_mode": False}, tmp_path)["changed"]

    # What the lead's rsync -a does: copy the whole models--ORG--REPO dir, symlinks preserved.
    repo_dir = Path(repo_cache_dir(str(head), PRIMARY))
    subprocess.run(["cp", "-a", str(repo_dir), str(worker)], check=True)
    snap = worker / "snapshots" / got["revision"]
    verify = {"path": str(snap), "manifest": str(worker / "manifests" / f"{got['revision']}.json"),
              "marker": str(tmp_path / "marker.json")}
    first = run_module("snapshot_verify", verify, tmp_path)
    assert first["complete"] and first["marker_written"] and first["changed"]
    assert not run_module("snapshot_verify", verify, tmp_path)["changed"]
    os.unlink(os.path.realpath(snap / "config.json"))
    broken = run_module("snapshot_verify", verify, tmp_path)
    assert broken["failed"] and broken["missing"] == ["config.json"] and broken["marker_removed"]
