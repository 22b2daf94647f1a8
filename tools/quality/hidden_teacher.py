"""A teacher given as its post-norm final hidden states plus its output head, instead of the model itself.

    python -m tools.quality.make_reference MODEL_DIR OUTDIR --hidden-states DIR --head FILE [--hidden-key ...]

A causal LM's next-token logits are its last hidden state, taken after the final RMSNorm, times the output
head: logits = hidden @ lm_head.T. A public suite ships exactly those two things for GLM-5.3 Flash
(malaiwah/GLM-5.3-Flash-fidelity-suite-v1), so a reference set can be made without the 640 GB BF16 model.
The windows mean what the model path's mean (tools/quality/make_reference.py): row i of top_ids/top_logprobs
is the teacher's distribution for token `scored_from + i` (the hidden state after token `scored_from + i - 1`),
the full-vocabulary log-softmax of float32 logits, rounded by the same `top_rows`.

Input layout (docs/quality-gate.md, "A teacher from hidden states"); every name is a flag, so a source
that names things otherwise maps onto it without a conversion step:
- DIR holds one safetensors file per window (`--hidden-glob`, default `*.safetensors`, read in name order);
  the window id is the file's stem.
- In each, tensor `--hidden-key` (default `hidden_states`): [T, H] or [T - 1, H], any float dtype. Row r is
  the state after token r. The last position's row predicts nothing in the window, so a source may leave it
  out (the suite does: 2,047 rows for 2,048 tokens).
- Token ids: tensor `--ids-key` (default `input_ids`, [T] integers) in the same file; or, with `--tokens
  TEMPLATE`, one JSON file per window, `{n}` in TEMPLATE standing for the digits that end the window file's
  stem (hidden_0007 -> 0007). The JSON is a list of ids, or an object holding the list under `--tokens-key`.
- The head: tensor `--head-key` (default `lm_head.weight`) of the safetensors file `--head`, [V, H]; a
  checkpoint shard that holds it will do.
- MODEL_DIR: the teacher's config.json (vocab and hidden size, checked against the head) and tokenizer
  files (hashed into the set's metadata); no weights are read.
The hidden states must already be past the final norm: nothing here applies one, because applying it twice
rescales every logit row (a temperature change the KLD would then measure).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .make_reference import file_sha256, reference_metadata, top_rows, write_set

SOURCE = "hidden_states+head"


@dataclass(frozen=True)
class HiddenLayout:
    """Where the reader finds each input; see the module docstring."""

    glob: str = "*.safetensors"
    hidden_key: str = "hidden_states"
    ids_key: str = "input_ids"
    tokens: str = ""
    tokens_key: str = "token_ids"
    head_key: str = "lm_head.weight"


def read_tensor(path: Path, key: str, flag: str) -> Any:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        if key not in handle.keys():
            found = {name: handle.get_slice(name).get_shape() for name in handle.keys()}
            raise SystemExit(f"{path}: no tensor {key!r} ({flag}); the file holds {found}")
        return handle.get_tensor(key)


def config_shape(model_dir: Path) -> tuple[int, int]:
    """(vocab_size, hidden_size) of the teacher's config.json; GLM-5.3 Flash keeps them in text_config."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise SystemExit(f"{path}: not found; MODEL_DIR must hold the teacher's config.json (not its weights)")
    config = json.loads(path.read_text())
    text = {**config, **(config.get("text_config") or {})}
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    if not isinstance(vocab, int) or not isinstance(hidden, int):
        raise SystemExit(f"{path}: no integer vocab_size and hidden_size (top level or text_config)")
    return vocab, hidden


def load_head(path: Path, key: str, vocab: int, hidden: int) -> Any:
    head = read_tensor(path, key, "--head-key")
    if list(head.shape) != [vocab, hidden]:
        hint = " (transposed? an output head is [vocab, hidden])" if list(head.shape) == [hidden, vocab] else ""
        raise SystemExit(f"{path}: head {key!r} is {list(head.shape)}, but config.json says "
                         f"[vocab_size, hidden_size] = [{vocab}, {hidden}]{hint}")
    return head


def window_tokens(path: Path, layout: HiddenLayout) -> tuple[list[int], Path]:
    """The window's token ids and the file they came from."""
    if not layout.tokens:
        ids = read_tensor(path, layout.ids_key, "--ids-key")
        if ids.dim() != 1 or ids.is_floating_point():
            raise SystemExit(f"{path}: {layout.ids_key!r} is {list(ids.shape)} {ids.dtype}; token ids are [T] ints")
        return [int(t) for t in ids.tolist()], path
    number = re.search(r"(\d+)$", path.stem)
    if number is None:
        raise SystemExit(f"{path}: --tokens needs the window file's name to end in a number, for {{n}}")
    token_path = Path(layout.tokens.replace("{n}", number.group(1)))
    try:
        payload = json.loads(token_path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{token_path}: cannot read the token ids of {path.name}: {exc}") from exc
    ids = payload.get(layout.tokens_key) if isinstance(payload, dict) else payload
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        found = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise SystemExit(f"{token_path}: expected a JSON list of token ids, or an object holding one under "
                         f"--tokens-key {layout.tokens_key!r}; found {found}")
    return ids, token_path


def hidden_window(window_id: str, tokens: list[int], hidden: Any, head: Any, top_k: int, max_tokens: int,
                  where: Path, head_path: Path) -> dict[str, Any]:
    """One window of the set from its ids, its hidden states and the float32 head."""
    import torch

    if hidden.dim() != 2 or hidden.shape[1] != head.shape[1]:
        raise SystemExit(f"{where}: hidden states are {list(hidden.shape)}, but the head {head_path} is "
                         f"{list(head.shape)}: the hidden size must match the head's second dimension")
    # Checked on the whole window, before any cut: another row count means the ids and rows are misaligned.
    if hidden.shape[0] not in (len(tokens), len(tokens) - 1):
        raise SystemExit(f"{where}: {hidden.shape[0]} rows of hidden states for {len(tokens)} token ids; "
                         f"expected {len(tokens)} or {len(tokens) - 1} (row r is the state after token r)")
    if not all(0 <= t < head.shape[0] for t in tokens):
        raise SystemExit(f"{where}: token ids outside the head's vocabulary 0..{head.shape[0] - 1}")
    tokens = tokens[:max_tokens]
    if len(tokens) < 2:
        raise SystemExit(f"{where}: {len(tokens)} token(s); a window needs at least 2")
    # Causal attention: the state after token r depends on tokens 0..r only, so cutting a window keeps its rows.
    rows = hidden[: len(tokens) - 1].float()
    # F.linear, as the model's own nn.Linear lm_head computes it.
    logits = torch.nn.functional.linear(rows, head)
    ids, values = top_rows(logits, top_k)
    # The source does not say how its windows were made; the suite's are teacher-forced text, no template.
    return {"id": window_id, "kind": "text", "token_ids": tokens, "scored_from": 1, "top_ids": ids,
            "top_logprobs": values}


def dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def make_reference_from_hidden(model_dir: Path, outdir: Path, hidden_dir: Path, head_path: Path,
                               layout: HiddenLayout = HiddenLayout(), *, top_k: int = 20, max_tokens: int = 512,
                               repo: str = "", revision: str = "", licence: str = "mit",
                               title: str = "GLM-5.3 Flash quality reference") -> dict[str, Any]:
    import torch

    files = sorted(hidden_dir.glob(layout.glob))
    if not files:
        raise SystemExit(f"{hidden_dir}: no window files match {layout.glob!r} (--hidden-glob)")
    vocab, hidden_size = config_shape(model_dir)
    if top_k > vocab:
        raise SystemExit(f"--top-k {top_k} exceeds the vocabulary ({vocab})")
    stored = load_head(head_path, layout.head_key, vocab, hidden_size)
    # Upcast once: the float32 values of the stored head, as the model path's float32 load holds them (2.5 GB
    # for GLM-5.3 Flash).
    head = stored.float()
    windows: list[dict[str, Any]] = []
    hidden_sha: dict[str, str] = {}
    token_sha: dict[str, str] = {}
    hidden_dtypes: set[str] = set()
    for path in files:
        hidden = read_tensor(path, layout.hidden_key, "--hidden-key")
        tokens, token_path = window_tokens(path, layout)
        windows.append(hidden_window(path.stem, tokens, hidden, head, top_k, max_tokens, path, head_path))
        hidden_sha[path.name] = file_sha256(path)
        if token_path != path:
            token_sha[token_path.name] = file_sha256(token_path)
        hidden_dtypes.add(dtype_name(hidden))
    teacher = {
        "repo": repo or hidden_dir.name, "revision": revision or "local", "source": SOURCE,
        "weights_dtype": dtype_name(stored), "compute_dtype": "float32",
        "engine": f"torch {torch.__version__}: log_softmax(hidden_states @ head.T)",
        "hidden_states": {"key": layout.hidden_key, "dtype": "/".join(sorted(hidden_dtypes)),
                          "semantic_point": "after_final_rmsnorm_before_lm_head", "sha256": hidden_sha},
        "tokens": {"from": layout.tokens or f"tensor {layout.ids_key!r} of each window file", "sha256": token_sha},
        "head": {"file": head_path.name, "key": layout.head_key, "shape": list(head.shape),
                 "sha256": file_sha256(head_path)},
    }
    prompt = {"chat_template": "none: the hidden-state source's token windows, teacher-forced",
              "chat_template_sha256": "", "enable_thinking": False, "add_generation_prompt": False,
              "reply_tokens": 0, "reply": "none", "text_windows": "token ids as the hidden-state source gives them"}
    return write_set(outdir, windows, reference_metadata(model_dir, top_k, teacher, prompt), licence, title)
