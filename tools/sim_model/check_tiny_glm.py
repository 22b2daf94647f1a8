"""Load a tiny GLM checkpoint with transformers and greedy-generate from a chat prompt.

    python -m tools.sim_model.check_tiny_glm MODEL_DIR [--tokens N]

MODEL_DIR is a BF16 checkpoint (`make_tiny_glm --bf16`, or the `--twin` of the EXL3 one).
Prints the rendered prompt, the reply with thinking off and on, and how often the reply followed the
planted word chain (1.0 would mean attention and experts never mattered). Exits non-zero when the reply
is empty, starts with EOS, or is a short loop.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args(argv)

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .hf_reference import nope_rotary
    from .make_tiny_glm import next_token_map

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    successor = next_token_map(Tokenizer.from_file(str(args.model_dir / "tokenizer.json")))
    messages = [{"role": "user", "content": "Explain how a hash map works."}]
    report: dict[str, object] = {}
    ok = True
    for thinking in (False, True):
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, enable_thinking=thinking, return_tensors="pt", return_dict=True
        )["input_ids"]
        with nope_rotary():
            out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        context = ids[0, -1:].tolist() + new
        followed = sum(successor.get(a) == b for a, b in zip(context, new)) / max(len(new), 1)
        text = tokenizer.decode(new, skip_special_tokens=False)
        report[f"thinking={thinking}"] = {
            "prompt": tokenizer.decode(ids[0]),
            "reply": text,
            "new_tokens": len(new),
            "distinct_tokens": len(set(new)),
            "followed_chain": round(followed, 2),
        }
        ok &= len(new) == args.tokens and len(set(new)) > len(new) // 3
    print(json.dumps(report, indent=2, ensure_ascii=False))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
