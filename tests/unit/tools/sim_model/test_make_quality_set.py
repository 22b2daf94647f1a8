# SPDX-License-Identifier: MIT
"""The simulation's quality reference set (tools/sim_model/make_quality_set.py over tools/quality/make_reference.py):
the gate reads what the tool writes, the teacher scores itself 0, a model that is not the seed's is refused,
and the simulated hub publishes the set like a model."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

# torch and transformers come with requirements-dev.txt: the tools import them, and fail (not skip) without.
from ansible_collections.sparkops.glm53.plugins.module_utils import quality as q
from tools.sim_model import make_quality_set, make_tiny_glm, serve_hub

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("quality")
    model = make_tiny_glm.write_checkpoint(root / "sim--tiny-glm", 0)
    out = root / "sim--tiny-glm-quality"
    # In a process of its own, as the tool runs: earlier tests import ansible into this one, which replaces
    # sys.intern, and torch._dynamo (imported by transformers here) refuses to load over the replacement.
    done = subprocess.run([sys.executable, "-m", "tools.sim_model.make_quality_set", str(out), "--from", str(model)],
                          cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return model, out


def test_the_gate_reads_the_set_with_the_recorded_settings(made: tuple[Path, Path]) -> None:
    _model, out = made
    ref = q.load_reference(str(out))
    meta = json.loads((out / "reference.json").read_text())
    assert ref.top_k == 20 and len(ref.windows) == 24 and ref.positions == meta["positions"] > 1000
    assert meta["prompt"]["enable_thinking"] is False and meta["teacher"]["weights_dtype"] == "bfloat16"
    assert {w.kind for w in ref.windows} == {"chat", "text"}
    assert all(len(w.token_ids) <= make_quality_set.MAX_TOKENS for w in ref.windows)
    # Full-vocabulary values, not renormalised: the top-20 of a 1024-token vocabulary rarely holds all mass.
    assert any(math.fsum(math.exp(v) for v in row) < 0.999 for w in ref.windows for row in w.top_logprobs)


def test_the_teacher_served_back_to_itself_scores_zero(made: tuple[Path, Path]) -> None:
    _model, out = made
    window = q.load_reference(str(out)).windows[0]
    served = [q.ServedPosition(dict(zip(ids, lps)), tuple(ids))
              for ids, lps in zip(window.top_ids, window.top_logprobs)]
    score = q.score_window(window, served)
    assert score.kld == pytest.approx(0.0, abs=1e-9) and score.top1 == 1.0


def test_a_rerun_is_up_to_date_and_another_seed_is_refused(made: tuple[Path, Path], capsys) -> None:
    model, out = made
    assert make_quality_set.main([str(out), "--from", str(model)]) == 0
    assert "is up to date" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        make_quality_set.main([str(out.parent / "other"), "--from", str(model), "--seed", "1"])
    assert "is not make_tiny_glm's output for seed 1" in capsys.readouterr().err


def test_the_simulated_hub_publishes_the_set_as_a_repo(made: tuple[Path, Path]) -> None:
    model, out = made
    assert serve_hub.discover_models(out.parent) == {"sim/tiny-glm": model, "sim/tiny-glm-quality": out}
