"""Make a quality-gate reference set: token windows with a teacher model's top-k next-token log-probabilities.

    python -m tools.quality.make_reference MODEL_DIR OUTDIR [--prompts FILE] [--top-k 20]
        [--reply-tokens 96] [--enable-thinking] [--repo ORG/NAME --revision SHA] [--device-map auto]
    python -m tools.quality.make_reference MODEL_DIR OUTDIR --hidden-states DIR --head FILE [--top-k 20]
        [--max-tokens 512] [--hidden-glob G] [--hidden-key K] [--ids-key K | --tokens TEMPLATE [--tokens-key K]]
        [--head-key K] [--repo ORG/NAME --revision SHA]

Run from the repository root with transformers and torch installed. MODEL_DIR is a Hugging Face
checkpoint the teacher is loaded from (the official BF16 GLM-5.3 Flash for production, about 640 GB,
so a multi-GPU machine with `--device-map auto`; the simulation's tiny BF16 twin on a laptop). The
output (format: docs/quality-gate.md) is `reference.json`, `windows.jsonl` and a README.md model card;
publish the directory as a hub repo and pin its revision in glm53_quality_repo / glm53_quality_revision.
With --hidden-states and --head the teacher is its post-norm hidden states and output head instead of the
model (tools/quality/hidden_teacher.py: the layout, and why the windows mean the same); MODEL_DIR then needs
only config.json and the tokenizer files.

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
each. Teacher: {teacher}. Made by `tools/quality/make_reference.py`; {windows_made}.
"""


def file_sha256(path: Path) -> str:
    if not path.is_file():
        return ""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        # In blocks: a hidden-state teacher's head is 1.3 GB.
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


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
    if teacher.get("source", "model") == "model":
        made = ("chat windows rendered with the teacher's chat template, "
                f"enable_thinking={str(metadata['prompt']['enable_thinking']).lower()}")
    else:
        made = (f"teacher given as {teacher['source']} (logits = hidden_states @ head.T), "
                "windows as that source gives them")
    (outdir / "README.md").write_text(MODEL_CARD.format(
        licence=licence, title=title, windows=metadata["windows"], positions=metadata["positions"],
        top_k=metadata["top_k"], teacher=f"{teacher['repo']}@{teacher['revision']}", windows_made=made))
    return metadata


def reference_metadata(model_dir: Path, top_k: int, teacher: dict[str, Any], prompt: dict[str, Any]) -> dict[str, Any]:
    """reference.json's fields before the windows are counted, whatever the teacher's source: MODEL_DIR's
    config and tokenizer are hashed in both, so a set names the model files it was made against."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "top_k": top_k,
        "windows_file": WINDOWS_FILE,
        "teacher": {**teacher, "config_sha256": file_sha256(model_dir / "config.json")},
        "tokenizer_sha256": file_sha256(model_dir / "tokenizer.json"),
        "prompt": prompt,
        "made_by": "tools/quality/make_reference.py",
    }


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
    teacher = {"repo": repo or model_dir.name, "revision": revision or "local", "source": "model",
               "weights_dtype": "bfloat16", "compute_dtype": "float32",
               "engine": f"transformers {transformers.__version__}"}
    prompt = {"chat_template": "the teacher's own (tokenizer_config.json / chat_template.jinja)",
              "chat_template_sha256": file_sha256(model_dir / "chat_template.jinja")
              or file_sha256(model_dir / "tokenizer_config.json"),
              "enable_thinking": thinking, "add_generation_prompt": True, "reply_tokens": reply_tokens,
              "reply": "teacher greedy", "text_windows": "tokenized as is, no special tokens"}
    return write_set(outdir, windows, reference_metadata(model_dir, top_k, teacher, prompt), licence, title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path,
                        help="the teacher's checkpoint; with --hidden-states only its config.json and tokenizer files")
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--top-k", type=int, default=20, help="vLLM serves at most --max-logprobs (20 by default)")
    parser.add_argument("--reply-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=512, help="window length cap")
    parser.add_argument("--enable-thinking", action="store_true")
    parser.add_argument("--repo", default="", help="teacher repo recorded in the set")
    parser.add_argument("--revision", default="", help="teacher revision recorded in the set")
    parser.add_argument("--device-map", default=None, help="transformers device_map, e.g. auto on a GPU machine")
    hidden = parser.add_argument_group("a teacher given as post-norm hidden states and its output head "
                                       "(layout: tools/quality/hidden_teacher.py)")
    hidden.add_argument("--hidden-states", type=Path, help="directory of one safetensors file per window")
    hidden.add_argument("--head", type=Path, help="safetensors file holding the output head [vocab, hidden]")
    hidden.add_argument("--hidden-glob", default="*.safetensors", help="window files in --hidden-states")
    hidden.add_argument("--hidden-key", default="hidden_states", help="hidden-state tensor in each window file")
    hidden.add_argument("--ids-key", default="input_ids", help="token-id tensor in each window file")
    hidden.add_argument("--tokens", default="", help="read token ids from JSON files instead: a path template, "
                        "{n} the number that ends a window file's name")
    hidden.add_argument("--tokens-key", default="token_ids", help="the id list's key when a token file is an object")
    hidden.add_argument("--head-key", default="lm_head.weight", help="head tensor in --head")
    args = parser.parse_args(argv)
    if not 1 <= args.top_k <= 1000:
        parser.error("--top-k must be within 1..1000")
    if (args.hidden_states is None) != (args.head is None):
        parser.error("--hidden-states and --head go together")
    if args.tokens and "{n}" not in args.tokens:
        parser.error("--tokens needs {n} where the window number goes, e.g. suite/tokens/context-{n}.json")
    if args.hidden_states is not None:
        from .hidden_teacher import HiddenLayout, make_reference_from_hidden

        layout = HiddenLayout(glob=args.hidden_glob, hidden_key=args.hidden_key, ids_key=args.ids_key,
                              tokens=args.tokens, tokens_key=args.tokens_key, head_key=args.head_key)
        meta = make_reference_from_hidden(args.model_dir, args.outdir, args.hidden_states, args.head, layout,
                                          top_k=args.top_k, max_tokens=args.max_tokens, repo=args.repo,
                                          revision=args.revision)
    else:
        meta = make_reference(args.model_dir, args.outdir, load_prompts(args.prompts), top_k=args.top_k,
                              reply_tokens=args.reply_tokens, thinking=args.enable_thinking,
                              max_tokens=args.max_tokens, repo=args.repo, revision=args.revision,
                              device_map=args.device_map)
    print(f"wrote {args.outdir}: {meta['windows']} windows, {meta['positions']} positions, top-{meta['top_k']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
