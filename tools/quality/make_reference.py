"""Make a quality-gate reference set: token windows with a teacher model's top-k next-token log-probabilities.

    python -m tools.quality.make_reference MODEL_DIR OUTDIR [--prompts FILE] [--top-k 20]
        [--reply-tokens 96] [--enable-thinking] [--repo ORG/NAME --revision SHA] [--device-map auto]

Run from the repository root with transformers and torch installed. MODEL_DIR is a Hugging Face
checkpoint the teacher is loaded from (the official BF16 GLM-5.3 Flash for production, about 640 GB,
so a multi-GPU machine with `--device-map auto`; the simulation's tiny BF16 twin on a laptop). The
output (format: docs/quality-gate.md) is `reference.json`, `windows.jsonl` and a README.md model card;
publish the directory as a hub repo and pin its revision in glm53_quality_repo / glm53_quality_revision.

Windows come from the prompts file (default: tools/quality/prompts.json):
- `chat` prompts are rendered with the model's own chat template (generation prompt added, thinking
  as --enable-thinking says, which must match how the gate's users prompt the served model), then the
  teacher greedily writes --reply-tokens tokens; the window is prompt + reply, so most scored positions
  are the kind of text the served model writes.
- `text` prompts are tokenized as they are (no template, no BOS added): plain-text continuation.

Each window is scored from its second token: row i of `top_ids`/`top_logprobs` is the teacher's
distribution for token `scored_from + i` given the tokens before it, as vLLM's `prompt_logprobs` index it.
Log-probabilities are the full-vocabulary log-softmax of float32 logits (the weights' BF16 values
upcast), rounded to 6 decimals; nothing is renormalised over the top-k.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMAT = "sparkops-glm53-quality-reference"
VERSION = 1
WINDOWS_FILE = "windows.jsonl"
DEFAULT_PROMPTS = Path(__file__).with_name("prompts.json")

MODEL_CARD = """---
license: {licence}
tags: [quality-gate, teacher-logits]
---
# {title}

Reference set of the sparkops.glm53 quality gate (docs/quality-gate.md of the collection): {windows}
token windows, {positions} scored positions, the teacher's top-{top_k} next-token log-probabilities at
each. Teacher: {teacher}. Made by `tools/quality/make_reference.py`; chat windows rendered with the
teacher's chat template, enable_thinking={thinking}.
"""


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def load_prompts(path: Path) -> list[dict[str, Any]]:
    prompts = json.loads(path.read_text())
    if not isinstance(prompts, list) or not prompts:
        raise SystemExit(f"{path}: expected a non-empty JSON list of prompts")
    for index, prompt in enumerate(prompts):
        kind = prompt.get("kind")
        if kind not in ("chat", "text") or not prompt.get("id") or not isinstance(prompt.get("content"), str):
            raise SystemExit(f"{path}[{index}]: each prompt needs id, kind (chat or text) and content")
    if len({p["id"] for p in prompts}) != len(prompts):
        raise SystemExit(f"{path}: prompt ids are not unique")
    return prompts


def top_rows(logits: Any, top_k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Top-k ids and full-vocabulary log-probabilities for every row of a [positions, vocab] tensor."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, top_k, dim=-1)
    return ids.tolist(), [[round(float(v), 6) for v in row] for row in values.tolist()]


def window_tokens(model: Any, tokenizer: Any, prompt: dict[str, Any], reply_tokens: int, thinking: bool,
                  max_tokens: int) -> list[int]:
    import torch

    if prompt["kind"] == "text":
        ids = tokenizer(prompt["content"], add_special_tokens=False)["input_ids"]
        return list(ids)[:max_tokens]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": prompt["content"]}], tokenize=True,
                                             add_generation_prompt=True, enable_thinking=thinking,
                                             return_dict=True)["input_ids"]
    ids = torch.tensor([list(rendered)], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=reply_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0].tolist()[:max_tokens]


def teacher_window(model: Any, window_id: str, kind: str, tokens: Sequence[int], top_k: int) -> dict[str, Any]:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(tokens)], device=model.device)).logits[0]
    # Row j predicts token j + 1; vLLM's prompt_logprobs[j + 1] is the same distribution.
    ids, values = top_rows(logits[:-1], top_k)
    return {"id": window_id, "kind": kind, "token_ids": list(tokens), "scored_from": 1,
            "top_ids": ids, "top_logprobs": values}


def write_set(outdir: Path, windows: list[dict[str, Any]], metadata: dict[str, Any], licence: str,
              title: str) -> dict[str, Any]:
    outdir.mkdir(parents=True, exist_ok=True)
    with (outdir / WINDOWS_FILE).open("w") as handle:
        for window in windows:
            handle.write(json.dumps(window, separators=(",", ":")) + "\n")
    metadata = {**metadata, "windows": len(windows), "positions": sum(len(w["top_ids"]) for w in windows),
                "windows_sha256": file_sha256(outdir / WINDOWS_FILE)}
    (outdir / "reference.json").write_text(json.dumps(metadata, indent=2) + "\n")
    teacher = metadata["teacher"]
    (outdir / "README.md").write_text(MODEL_CARD.format(
        licence=licence, title=title, windows=metadata["windows"], positions=metadata["positions"],
        top_k=metadata["top_k"], teacher=f"{teacher['repo']}@{teacher['revision']}",
        thinking=str(metadata["prompt"]["enable_thinking"]).lower()))
    return metadata


def make_reference(model_dir: Path, outdir: Path, prompts: list[dict[str, Any]], *, top_k: int = 20,
                   reply_tokens: int = 96, thinking: bool = False, max_tokens: int = 512, repo: str = "",
                   revision: str = "", device_map: str | None = None, licence: str = "mit",
                   title: str = "GLM-5.3 Flash quality reference") -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map=device_map)
    model.eval()
    windows = []
    for prompt in prompts:
        tokens = window_tokens(model, tokenizer, prompt, reply_tokens, thinking, max_tokens)
        if len(tokens) < 2:
            raise SystemExit(f"prompt {prompt['id']} gives {len(tokens)} token(s); a window needs at least 2")
        windows.append(teacher_window(model, prompt["id"], prompt["kind"], tokens, top_k))
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "top_k": top_k,
        "windows_file": WINDOWS_FILE,
        "teacher": {"repo": repo or model_dir.name, "revision": revision or "local", "weights_dtype": "bfloat16",
                    "compute_dtype": "float32", "engine": f"transformers {transformers.__version__}",
                    "config_sha256": file_sha256(model_dir / "config.json")},
        "tokenizer_sha256": file_sha256(model_dir / "tokenizer.json"),
        "prompt": {"chat_template": "the teacher's own (tokenizer_config.json / chat_template.jinja)",
                   "chat_template_sha256": file_sha256(model_dir / "chat_template.jinja")
                   or file_sha256(model_dir / "tokenizer_config.json"),
                   "enable_thinking": thinking, "add_generation_prompt": True, "reply_tokens": reply_tokens,
                   "reply": "teacher greedy", "text_windows": "tokenized as is, no special tokens"},
        "made_by": "tools/quality/make_reference.py",
    }
    return write_set(outdir, windows, metadata, licence, title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--top-k", type=int, default=20, help="vLLM serves at most --max-logprobs (20 by default)")
    parser.add_argument("--reply-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=512, help="window length cap")
    parser.add_argument("--enable-thinking", action="store_true")
    parser.add_argument("--repo", default="", help="teacher repo recorded in the set")
    parser.add_argument("--revision", default="", help="teacher revision recorded in the set")
    parser.add_argument("--device-map", default=None, help="transformers device_map, e.g. auto on a GPU machine")
    args = parser.parse_args(argv)
    if not 1 <= args.top_k <= 1000:
        parser.error("--top-k must be within 1..1000")
    meta = make_reference(args.model_dir, args.outdir, load_prompts(args.prompts), top_k=args.top_k,
                          reply_tokens=args.reply_tokens, thinking=args.enable_thinking, max_tokens=args.max_tokens,
                          repo=args.repo, revision=args.revision, device_map=args.device_map)
    print(f"wrote {args.outdir}: {meta['windows']} windows, {meta['positions']} positions, top-{meta['top_k']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
