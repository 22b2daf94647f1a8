"""Write a degenerate tiny GLM: it loads, serves and passes /health, but every reply is empty.

    python -m tools.sim_model.make_degenerate OUTDIR [--from MODEL_DIR | --seed N]

Run from the repository root. It takes a checkpoint written by
`tools.sim_model.make_tiny_glm.write_checkpoint` (the one in MODEL_DIR, or a new one for the seed), then
rewrites two tensors so that end-of-sequence wins the first step of every generation: the engine answers
HTTP 200 with empty text, as a broken engine (bad weights, wrong kernels) does while /health stays green.
Only `model.embed_tokens.weight` and `lm_head.weight` change; the configs, tokenizer and every other tensor
(EXL3 or BF16) are the source's, so the degenerate model starts exactly like the good one. The output is
byte-identical for a given source. With --from, the model card records the source's digest and a re-run
against the same source writes nothing and prints "up to date" (the simulated cluster runs it on every
`up.yml`).

How: every token embedding gets a large constant on one hidden dimension, so the final RMSNorm output
is positive there whatever the layers add; lm_head is zero except the EOS row, which reads only that
dimension. EOS then has a logit of about GAIN * sqrt(hidden) and every other token exactly 0.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
# The hidden dimension that carries the constant; any one works.
CARRIER_DIM = 0
# Embedding rows are ~N(0, 1): a constant of 64 dominates them and whatever the blocks add.
CARRIER_VALUE = 64.0
EOS_GAIN = 8.0

MODEL_CARD = """---
license: mit
library_name: transformers
pipeline_tag: text-generation
---
# tiny-glm-eos (simulation, degenerate on purpose)

The simulated cluster's tiny GLM with end-of-sequence planted as the answer to everything: it serves,
passes /health and returns empty replies. Made by `tools/sim_model/make_degenerate.py` to prove that the
launch's canary catches an engine that is up but broken.

source: {source}
"""


def source_digest(model_dir: Path) -> str:
    """sha256 over the names and bytes of the source's files (README excluded): what the output derives from."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != "README.md"):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def eos_token_id(model_dir: Path) -> int:
    """The id the chat completions stop on: the tokenizer's eos_token (also first in generation_config)."""
    from tokenizers import Tokenizer

    name = json.loads((model_dir / "tokenizer_config.json").read_text())["eos_token"]
    token_id = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(name)
    if token_id is None:
        raise ValueError(f"eos_token {name!r} is not in {model_dir / 'tokenizer.json'}")
    return int(token_id)


def plant_eos(embed: torch.Tensor, lm_head: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """New (embed, lm_head) for which greedy decoding picks `eos_id` first, in the tensors' own dtypes."""
    import torch

    if embed.shape[1] != lm_head.shape[1] or not 0 <= eos_id < lm_head.shape[0]:
        raise ValueError(f"embed {tuple(embed.shape)}, lm_head {tuple(lm_head.shape)} and eos id {eos_id} do not fit")
    new_embed = embed.float().clone()
    new_embed[:, CARRIER_DIM] = CARRIER_VALUE
    new_head = torch.zeros(lm_head.shape, dtype=torch.float32)
    new_head[eos_id, CARRIER_DIM] = EOS_GAIN
    return new_embed.to(embed.dtype).contiguous(), new_head.to(lm_head.dtype).contiguous()


def make_degenerate(model_dir: Path) -> list[str]:
    """Rewrite, in place, the safetensors files of `model_dir` that hold the embedding or lm_head."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    eos_id = eos_token_id(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    tensors_by_file: dict[Path, tuple[dict[str, torch.Tensor], dict[str, str]]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
            if EMBED in names or LM_HEAD in names:
                tensors_by_file[path] = ({n: handle.get_tensor(n) for n in names}, handle.metadata() or {})
    found = {name: path for path, (tensors, _metadata) in tensors_by_file.items() for name in tensors if name in (EMBED, LM_HEAD)}
    if set(found) != {EMBED, LM_HEAD}:
        raise ValueError(f"{model_dir} lacks {sorted({EMBED, LM_HEAD} - set(found))} (tied embeddings are not supported)")
    embed, head = plant_eos(tensors_by_file[found[EMBED]][0][EMBED], tensors_by_file[found[LM_HEAD]][0][LM_HEAD], eos_id)
    tensors_by_file[found[EMBED]][0][EMBED] = embed
    tensors_by_file[found[LM_HEAD]][0][LM_HEAD] = head
    for path, (tensors, metadata) in tensors_by_file.items():
        save_file(tensors, str(path), metadata=metadata)
    return [path.name for path in tensors_by_file]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--from", dest="source", type=Path, help="derive from this make_tiny_glm checkpoint")
    source.add_argument("--seed", type=int, default=0, help="write a new make_tiny_glm checkpoint with this seed")
    args = parser.parse_args(argv)
    path: Path = args.outdir
    if args.source is not None:
        provenance = f"{args.source.name} sha256:{source_digest(args.source)}"
        card = path / "README.md"
        if card.is_file() and f"source: {provenance}\n" in card.read_text():
            print(f"{path} is up to date ({provenance})")
            return 0
        if path.exists():
            shutil.rmtree(path)
        shutil.copytree(args.source, path)
    else:
        from .make_tiny_glm import write_checkpoint

        provenance = f"make_tiny_glm.write_checkpoint seed {args.seed}"
        write_checkpoint(path, args.seed)
    changed = make_degenerate(path)
    (path / "README.md").write_text(MODEL_CARD.format(source=provenance))
    print(f"wrote {path} (EOS planted in {', '.join(changed)}; source {provenance})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
