# SPDX-License-Identifier: MIT
"""Run by test_hidden_teacher.py in a process of its own: the simulation's tiny BF16 teacher (the EXL3 tiny
GLM's twin, as tools/sim_model/make_quality_set.py makes it), a reference set made from the model by
make_reference, and the same teacher's post-norm hidden states for that set's windows, in the hidden-state
layout (tools/quality/hidden_teacher.py). In a process of its own because transformers cannot load where the
unit tests have imported ansible (it replaces sys.intern, which torch._dynamo refuses to load over).

    python tests/unit/tools/quality/tiny_teacher.py ROOT

writes ROOT/twin (its model.safetensors holds lm_head.weight, the head), ROOT/from-model (the set),
ROOT/hidden/<window id>.safetensors (input_ids [T] int64, hidden_states [T, H] float32) and ROOT/post_norm.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tools.quality.make_reference import DEFAULT_PROMPTS, load_prompts, make_reference
from tools.sim_model.hf_reference import nope_rotary
from tools.sim_model.make_tiny_glm import write_checkpoint

# Two windows of each kind, short: the equivalence does not depend on length, and the test stays in seconds.
REPLY_TOKENS, MAX_TOKENS = 8, 40


def main(root: Path) -> None:
    write_checkpoint(root / "exl3", 0, twin=root / "twin")
    prompts = load_prompts(DEFAULT_PROMPTS)
    picked = [p for p in prompts if p["kind"] == "chat"][:2] + [p for p in prompts if p["kind"] == "text"][:2]
    (root / "hidden").mkdir()
    post_norm = {}
    with nope_rotary():
        make_reference(root / "twin", root / "from-model", picked, reply_tokens=REPLY_TOKENS, max_tokens=MAX_TOKENS,
                       repo="sim/tiny-glm BF16 twin", revision="seed 0")
        model = AutoModelForCausalLM.from_pretrained(root / "twin", dtype=torch.float32)
        model.eval()
        for line in (root / "from-model" / "windows.jsonl").read_text().splitlines():
            window = json.loads(line)
            ids = torch.tensor([window["token_ids"]])
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
                # The base model's last_hidden_state is what lm_head reads: after the final norm.
                last = model.model(input_ids=ids).last_hidden_state[0]
                # Evidence of the cut: the head alone reproduces the model's logits from it. transformers 5.19 also
                # returns the post-norm state as output_hidden_states' last entry; recorded, not relied on.
                post_norm[window["id"]] = {
                    "last_hidden_state": (model.lm_head(last) - out.logits[0]).abs().max().item(),
                    "hidden_states[-1]": (model.lm_head(out.hidden_states[-1][0]) - out.logits[0]).abs().max().item(),
                }
            save_file({"input_ids": ids[0].to(torch.int64), "hidden_states": last.contiguous()},
                      str(root / "hidden" / f"{window['id']}.safetensors"))
    (root / "post_norm.json").write_text(json.dumps(post_norm, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
