# SPDX-License-Identifier: MIT
"""The revision_prune module as Ansible runs it, on a tmp Hugging Face cache holding a model and a draft."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict

import pytest

ModuleRunner = Callable[..., Dict[str, Any]]
MODEL, DRAFT = "org/model", "org/draft"
OLD, NEW, DRAFT_OLD, DRAFT_NEW = "1" * 40, "2" * 40, "3" * 40, "4" * 40


def repo_dir(hub: Path, repo_id: str) -> Path:
    return hub / ("models--" + repo_id.replace("/", "--"))


def revision(hub: Path, repo_id: str, sha: str, files: Dict[str, int], ref: str = "") -> None:
    """A downloaded revision: links into blobs (a blob named like the file and size is shared by revisions
    that have both), our manifest and sync marker, and optionally a ref naming it."""
    repo = repo_dir(hub, repo_id)
    for rel, size in files.items():
        blob = repo / "blobs" / f"{rel}-{size}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(b"x" * size)
        link = repo / "snapshots" / sha / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "manifests").mkdir(exist_ok=True)
    (repo / "manifests" / f"{sha}.json").write_text("{}")
    (hub / ".glm53-sync").mkdir(exist_ok=True)
    (hub / ".glm53-sync" / f"{repo.name}@{sha}.json").write_text("{}")
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(sha)


@pytest.fixture
def hub(tmp_path: Path) -> Path:
    hub = tmp_path / "huggingface" / "hub"
    revision(hub, MODEL, OLD, {"config.json": 10, "model.safetensors": 1000}, ref="v1")
    revision(hub, MODEL, NEW, {"config.json": 10, "model.safetensors": 2000}, ref="main")
    revision(hub, DRAFT, DRAFT_OLD, {"model.safetensors": 300})
    revision(hub, DRAFT, DRAFT_NEW, {"model.safetensors": 400})
    return hub


def tree(hub: Path) -> list[str]:
    return sorted(str(p.relative_to(hub)) for p in hub.rglob("*"))


def args(hub: Path, **extra: Any) -> Dict[str, Any]:
    return dict({"cache_dir": str(hub), "repos": [MODEL, DRAFT], "keep": [NEW, DRAFT_NEW]}, **extra)


EXPECTED_PRUNED = [{"repo_id": MODEL, "revision": OLD, "bytes": 1000},
                   {"repo_id": DRAFT, "revision": DRAFT_OLD, "bytes": 300}]


def test_prunes_old_revisions_of_each_repo_with_their_manifest_marker_and_ref(
        hub: Path, run_module: ModuleRunner) -> None:
    result = run_module("revision_prune", args(hub))
    assert result["changed"] is True and not result.get("failed")
    assert result["pruned"] == EXPECTED_PRUNED and result["freed_bytes"] == 1300
    assert result["kept"] == [NEW, DRAFT_NEW]
    model, draft = repo_dir(hub, MODEL), repo_dir(hub, DRAFT)
    assert os.listdir(model / "snapshots") == [NEW] and os.listdir(draft / "snapshots") == [DRAFT_NEW]
    assert os.listdir(model / "manifests") == [f"{NEW}.json"]
    assert sorted(os.listdir(hub / ".glm53-sync")) == [f"{draft.name}@{DRAFT_NEW}.json", f"{model.name}@{NEW}.json"]
    assert os.listdir(model / "refs") == ["main"]
    # The shared config blob stays and the kept snapshot still reads through its links.
    assert sorted(os.listdir(model / "blobs")) == ["config.json-10", "model.safetensors-2000"]
    assert (model / "snapshots" / NEW / "model.safetensors").stat().st_size == 2000
    again = run_module("revision_prune", args(hub))
    assert again["changed"] is False and again["pruned"] == [] and again["freed_bytes"] == 0
    assert again["kept"] == [NEW, DRAFT_NEW]


@pytest.mark.parametrize("how", ["planned", "check mode"])
def test_planned_and_check_mode_report_and_delete_nothing(how: str, hub: Path, run_module: ModuleRunner) -> None:
    before = tree(hub)
    if how == "planned":
        result = run_module("revision_prune", args(hub, state="planned"))
        assert result["changed"] is False
    else:
        result = run_module("revision_prune", args(hub), check=True)
        assert result["changed"] is True
    assert result["pruned"] == EXPECTED_PRUNED and result["freed_bytes"] == 1300
    assert tree(hub) == before


def test_a_repo_none_of_whose_revisions_is_kept_loses_all_and_others_are_not_looked_at(
        hub: Path, run_module: ModuleRunner) -> None:
    result = run_module("revision_prune", args(hub, repos=[DRAFT, DRAFT], keep=[NEW]))
    assert [(p["revision"], p["bytes"]) for p in result["pruned"]] == [(DRAFT_OLD, 300), (DRAFT_NEW, 400)]
    assert result["kept"] == [] and result["freed_bytes"] == 700
    assert os.listdir(repo_dir(hub, DRAFT) / "snapshots") == []
    assert sorted(os.listdir(repo_dir(hub, MODEL) / "snapshots")) == [OLD, NEW]  # not in repos


def test_a_cache_without_the_repos_changes_nothing(tmp_path: Path, run_module: ModuleRunner) -> None:
    result = run_module("revision_prune", args(tmp_path / "absent"))
    assert result["changed"] is False and result["pruned"] == [] and result["kept"] == []
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize("keep, says", [
    ([], "keep must name at least one revision"),
    (["", "  "], "keep must name at least one revision"),
    ([NEW, "main"], "keep takes commit shas"),
    (["ab" * 20, "AB" * 20], "keep takes commit shas"),
])
def test_keep_must_name_commit_shas(keep: list[str], says: str, hub: Path, run_module: ModuleRunner) -> None:
    before = tree(hub)
    result = run_module("revision_prune", args(hub, keep=keep))
    assert result["failed"] and says in result["msg"] and result["pruned"] == []
    assert tree(hub) == before


def test_needed_bytes_judges_the_disk_counting_what_a_prune_would_free(hub: Path, run_module: ModuleRunner) -> None:
    # Free space moves while the suite runs: the far cases are exact, the near one is judged on the module's own
    # reading of it.
    assert run_module("revision_prune", args(hub, state="planned", needed_bytes=0))["disk"]["fits_now"]
    short = run_module("revision_prune", args(hub, state="planned", needed_bytes=2 ** 60))["disk"]
    assert (short["fits_now"], short["fits_after_prune"], short["prunable_bytes"]) == (False, False, 1300)
    assert short["message"].endswith("short even after pruning")
    near = run_module("revision_prune", args(hub, state="planned", needed_bytes=shutil.disk_usage(hub).free + 650))["disk"]
    assert near["fits_now"] == (near["free_bytes"] >= near["needed_bytes"])
    assert near["fits_after_prune"] == (near["free_bytes"] + 1300 >= near["needed_bytes"])
    # Once pruned, nothing is left to free: the verdict counts only the free space.
    pruned = run_module("revision_prune", args(hub, needed_bytes=0))
    assert pruned["disk"]["prunable_bytes"] == 0 and pruned["pruned"]
    assert "disk" not in run_module("revision_prune", args(hub, state="planned"))
