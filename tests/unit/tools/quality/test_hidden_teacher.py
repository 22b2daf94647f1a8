# SPDX-License-Identifier: MIT
"""A teacher given as post-norm hidden states plus its output head (tools/quality/hidden_teacher.py through
make_reference --hidden-states): on the simulation's tiny BF16 teacher it makes the set the model makes, the
suite's names and row count map by flags, and a head or hidden state of the wrong shape is refused by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# torch and safetensors come with requirements-dev.txt: the tool imports them, and fails (not skips) without.
import torch
from safetensors.torch import load_file, save_file

from ansible_collections.sparkops.glm53.plugins.module_utils import quality as q
from tools.quality import make_reference as mr

REPO = Path(__file__).resolve().parents[4]
# Measured on the tiny teacher (4 windows, 149 positions): the two sets' log-probabilities are equal to the last
# of the 6 decimals they keep. One unit of that decimal is allowed: a float32 product blocked differently (another
# BLAS, or fewer rows: test_a_cut_window_keeps_the_rows_of_its_prefix) can flip a rounding.
LOGPROB_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hidden-teacher")
    # transformers in a process of its own: the unit tests import ansible, which replaces sys.intern, and
    # torch._dynamo (imported by transformers) refuses to load over the replacement.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / ".collections")])}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("tiny_teacher.py")), str(root)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def windows(directory: Path) -> dict[str, dict[str, Any]]:
    lines = (directory / mr.WINDOWS_FILE).read_text().splitlines()
    return {window["id"]: window for window in map(json.loads, lines)}


def assert_same_rows(expected: dict[str, Any], got: dict[str, Any], tolerance: float) -> None:
    assert got["token_ids"] == expected["token_ids"] and got["scored_from"] == expected["scored_from"] == 1
    assert len(got["top_ids"]) == len(expected["top_ids"]) == len(expected["token_ids"]) - 1
    for row, (ids_a, lps_a, ids_b, lps_b) in enumerate(zip(expected["top_ids"], expected["top_logprobs"],
                                                           got["top_ids"], got["top_logprobs"])):
        # + 1e-9: a difference of two 6-decimal values is itself not exact in binary.
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) <= tolerance + 1e-9, (expected["id"], row)
        for rank, (a, b) in enumerate(zip(ids_a, ids_b)):
            # Tokens may trade places only at an exact tie: the teacher's value at that rank is listed twice.
            assert a == b or lps_a.count(lps_a[rank]) > 1, (expected["id"], row, rank, a, b)


def make_from_hidden(model_dir: Path, out: Path, hidden: Path, head: Path, *flags: str) -> dict[str, Any]:
    assert mr.main([str(model_dir), str(out), "--hidden-states", str(hidden), "--head", str(head), *flags]) == 0
    return json.loads((out / "reference.json").read_text())


def test_the_exported_states_are_post_norm_the_head_alone_gives_the_models_logits(teacher: Path) -> None:
    cut = json.loads((teacher / "post_norm.json").read_text())
    assert len(cut) == 4
    assert all(diff["last_hidden_state"] == 0.0 for diff in cut.values()), cut


def test_a_set_from_hidden_states_and_head_is_the_set_the_model_makes(teacher: Path, tmp_path: Path) -> None:
    twin = teacher / "twin"
    # The head straight from the checkpoint: its lm_head.weight is the default --head-key.
    meta = make_from_hidden(twin, tmp_path / "out", teacher / "hidden", twin / "model.safetensors")
    model_meta = json.loads((teacher / "from-model" / "reference.json").read_text())
    expected, got = windows(teacher / "from-model"), windows(tmp_path / "out")
    assert sorted(got) == sorted(expected) and meta["positions"] == model_meta["positions"]
    for window_id, window in expected.items():
        assert_same_rows(window, got[window_id], LOGPROB_TOLERANCE)
    # The same metadata, the teacher marked as hidden states + head with the digests of what it read.
    assert meta.keys() == model_meta.keys() and meta["prompt"].keys() == model_meta["prompt"].keys()
    assert model_meta["teacher"]["source"] == "model" and meta["teacher"]["source"] == "hidden_states+head"
    assert meta["top_k"] == model_meta["top_k"] and meta["tokenizer_sha256"] == model_meta["tokenizer_sha256"]
    assert meta["teacher"]["config_sha256"] == model_meta["teacher"]["config_sha256"]
    hidden_files = sorted((teacher / "hidden").glob("*.safetensors"))
    assert meta["teacher"]["hidden_states"]["sha256"] == {p.name: mr.file_sha256(p) for p in hidden_files}
    assert meta["teacher"]["head"] == {"file": "model.safetensors", "key": "lm_head.weight", "shape": [1024, 128],
                                       "sha256": mr.file_sha256(twin / "model.safetensors")}
    assert q.load_reference(str(tmp_path / "out")).positions == meta["positions"]


def test_the_suites_names_bf16_rows_and_json_tokens_map_by_flags(teacher: Path, tmp_path: Path) -> None:
    # The suite's layout: hidden_NNNN.safetensors holding only hidden_states, bf16, one row fewer than the window
    # (the last position predicts nothing); ids in tokens/context-NNNN.json; the head under "weight".
    lane, tokens, head = tmp_path / "lane", tmp_path / "tokens", tmp_path / "head.safetensors"
    lane.mkdir()
    tokens.mkdir()
    order = sorted(windows(teacher / "from-model"))
    for number, window_id in enumerate(order):
        exported = load_file(str(teacher / "hidden" / f"{window_id}.safetensors"))
        rows = exported["hidden_states"][:-1].to(torch.bfloat16).contiguous()
        save_file({"hidden_states": rows}, str(lane / f"hidden_{number:04d}.safetensors"))
        ids = exported["input_ids"].tolist()
        # A plain list, or an object holding it: the suite's token files are not verified to be either.
        (tokens / f"context-{number:04d}.json").write_text(json.dumps(ids if number % 2 else {"ids": ids}))
    save_file({"weight": load_file(str(teacher / "twin" / "model.safetensors"))["lm_head.weight"]}, str(head))
    meta = make_from_hidden(teacher / "twin", tmp_path / "out", lane, head, "--hidden-glob", "hidden_*.safetensors",
                            "--tokens", str(tokens / "context-{n}.json"), "--tokens-key", "ids",
                            "--head-key", "weight")
    assert meta["teacher"]["hidden_states"]["dtype"] == "bfloat16" and len(meta["teacher"]["tokens"]["sha256"]) == 4
    expected, got = windows(teacher / "from-model"), windows(tmp_path / "out")
    reference = q.load_reference(str(tmp_path / "out"))
    for number, window_id in enumerate(order):
        window = got[f"hidden_{number:04d}"]
        assert window["token_ids"] == expected[window_id]["token_ids"]
        # BF16 storage of the states is the only difference. The gate, scoring this set against the model's,
        # measured top-1 1.0 and 1.9e-7 to 2.5e-7 nats per window on the tiny model; rows shifted by one
        # position measured 0.07 to 0.18 nats with top-1 0 to 0.10.
        served = [q.ServedPosition(dict(zip(ids, lps)), tuple(ids))
                  for ids, lps in zip(window["top_ids"], window["top_logprobs"])]
        gated = next(w for w in q.load_reference(str(teacher / "from-model")).windows if w.id == window_id)
        score = q.score_window(gated, served)
        assert score.top1 == 1.0 and score.kld < 1e-5, (window_id, score)
    assert reference.positions == meta["positions"]


def test_a_cut_window_keeps_the_rows_of_its_prefix(teacher: Path, tmp_path: Path) -> None:
    twin = teacher / "twin"
    make_from_hidden(twin, tmp_path / "cut", teacher / "hidden", twin / "model.safetensors", "--max-tokens", "12")
    whole = windows(teacher / "from-model")
    for window_id, window in windows(tmp_path / "cut").items():
        prefix = {**whole[window_id], "token_ids": whole[window_id]["token_ids"][:12],
                  "top_ids": whole[window_id]["top_ids"][:11], "top_logprobs": whole[window_id]["top_logprobs"][:11]}
        # Measured: 11 rows instead of the whole window's change the float32 product's blocking, and a few values
        # differ by one unit of the 6th decimal; the tolerance exists for exactly that.
        assert_same_rows(prefix, window, LOGPROB_TOLERANCE)


VOCAB, HIDDEN, TOKENS = 64, 16, 6


@pytest.mark.parametrize(("case", "message"), [
    ("transposed head", r"head\.safetensors: head 'lm_head\.weight' is \[16, 64\], but config\.json says "
                        r"\[vocab_size, hidden_size\] = \[64, 16\] \(transposed\?"),
    ("another vocabulary", r"head\.safetensors: head 'lm_head\.weight' is \[60, 16\], but config\.json says "
                           r"\[vocab_size, hidden_size\] = \[64, 16\]$"),
    ("another hidden size", r"w-0001\.safetensors: hidden states are \[6, 12\], but the head \S*head\.safetensors "
                            r"is \[64, 16\]"),
    ("misaligned rows", r"w-0001\.safetensors: 4 rows of hidden states for 6 token ids; expected 6 or 5"),
    ("unmapped head name", r"head\.safetensors: no tensor 'weight' \(--head-key\); the file holds "
                           r"\{'lm_head\.weight': \[64, 16\]\}"),
])
def test_a_wrong_head_or_hidden_size_is_refused_naming_the_file_and_shapes(tmp_path: Path, case: str,
                                                                           message: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    # Nested as GLM-5.3 Flash's config.json nests them (transformers' Glm5NextConfig.text_config).
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": VOCAB, "hidden_size": HIDDEN}}))
    gen = torch.Generator().manual_seed(0)
    rows = {"another hidden size": (TOKENS, 12), "misaligned rows": (4, HIDDEN)}.get(case, (TOKENS, HIDDEN))
    (tmp_path / "hidden").mkdir()
    save_file({"input_ids": torch.arange(TOKENS), "hidden_states": torch.randn(*rows, generator=gen)},
              str(tmp_path / "hidden" / "w-0001.safetensors"))
    shape = {"transposed head": (HIDDEN, VOCAB), "another vocabulary": (60, HIDDEN)}.get(case, (VOCAB, HIDDEN))
    head = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    save_file({"lm_head.weight": head}, str(tmp_path / "head.safetensors"))
    flags = ["--head-key", "weight"] if case == "unmapped head name" else []
    with pytest.raises(SystemExit, match=message):
        make_from_hidden(model, tmp_path / "out", tmp_path / "hidden", tmp_path / "head.safetensors", *flags)
    assert not (tmp_path / "out").exists()


def test_the_right_shapes_pass_the_same_checks(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"vocab_size": VOCAB, "hidden_size": HIDDEN}}))
    (tmp_path / "hidden").mkdir()
    save_file({"input_ids": torch.arange(TOKENS), "hidden_states": torch.randn(TOKENS - 1, HIDDEN)},
              str(tmp_path / "hidden" / "w-0001.safetensors"))
    save_file({"lm_head.weight": torch.randn(VOCAB, HIDDEN)}, str(tmp_path / "head.safetensors"))
    meta = make_from_hidden(model, tmp_path / "out", tmp_path / "hidden", tmp_path / "head.safetensors")
    assert meta["positions"] == TOKENS - 1 and meta["teacher"]["head"]["shape"] == [VOCAB, HIDDEN]
