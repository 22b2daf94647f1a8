"""--if-changed: a generated checkpoint is kept while its generator code is unchanged and replaced when it changes."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools.sim_model import make_tiny_glm, provenance


def test_a_stamp_matches_only_its_own_provenance(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("card\n")
    assert not provenance.up_to_date(tmp_path, "make_tiny_glm seed 0 generator sha256:aa")
    provenance.stamp(tmp_path, "make_tiny_glm seed 0 generator sha256:aa")
    assert provenance.up_to_date(tmp_path, "make_tiny_glm seed 0 generator sha256:aa")
    assert not provenance.up_to_date(tmp_path, "make_tiny_glm seed 0 generator sha256:ab")
    assert not provenance.up_to_date(tmp_path / "missing", "make_tiny_glm seed 0 generator sha256:aa")


def test_the_digest_covers_the_generators_and_the_exl3_writer() -> None:
    names = {path.name for directory in provenance.GENERATOR_DIRS for path in directory.glob("*.py")}
    assert {"make_tiny_glm.py", "make_tiny_dflash.py", "writer.py"} <= names
    assert len(provenance.generator_digest()) == 64


def test_if_changed_keeps_an_up_to_date_model_and_replaces_one_from_other_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "tiny-glm"
    assert make_tiny_glm.main([str(out), "--if-changed"]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    weights = (out / "model.safetensors").stat().st_mtime_ns
    leftover = out / "from-older-code.txt"
    leftover.write_text("x")

    assert make_tiny_glm.main([str(out), "--if-changed"]) == 0
    assert "is up to date" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == weights and leftover.exists()

    monkeypatch.setattr(provenance, "generator_digest", lambda: "0" * 64)
    assert make_tiny_glm.main([str(out), "--if-changed"]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    assert not leftover.exists()
    assert provenance.up_to_date(out, "make_tiny_glm seed 0 generator sha256:" + "0" * 64)
