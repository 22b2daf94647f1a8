"""Write the simulation's quality reference set: the tiny GLM's BF16 twin as the teacher.

    python -m tools.sim_model.make_quality_set OUTDIR --from MODEL_DIR [--seed N]

Run from the repository root. MODEL_DIR is the EXL3 tiny GLM the simulated cluster serves
(`make_tiny_glm` with seed N). Its exact BF16 twin (the EXL3 linears decoded) is regenerated from the
seed, after checking that the regenerated EXL3 files are byte-identical to MODEL_DIR's, and run through
transformers by `tools.quality.make_reference` over tools/quality/prompts.json with the production
settings except shorter windows (the tiny model's context is 1024). The output is the reference set the
simulated hub publishes as sim/tiny-glm-quality. A re-run against the same source prints "up to date".
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from tools.quality.make_reference import DEFAULT_PROMPTS, load_prompts, make_reference

from .hf_reference import nope_rotary
from .make_degenerate import source_digest
from .make_tiny_glm import write_checkpoint

TOP_K = 20
REPLY_TOKENS = 32
MAX_TOKENS = 96


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--from", dest="source", type=Path, required=True, help="the EXL3 tiny GLM checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="the make_tiny_glm seed MODEL_DIR was written with")
    args = parser.parse_args(argv)
    provenance = f"{args.source.name} sha256:{source_digest(args.source)} seed {args.seed}"
    card = args.outdir / "README.md"
    if card.is_file() and f"source: {provenance}\n" in card.read_text():
        print(f"{args.outdir} is up to date ({provenance})")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        exl3, twin = Path(scratch) / "exl3", Path(scratch) / "twin"
        write_checkpoint(exl3, args.seed, twin=twin)
        if source_digest(exl3) != source_digest(args.source):
            parser.error(f"{args.source} is not make_tiny_glm's output for seed {args.seed}; pass its --seed")
        if args.outdir.exists():
            shutil.rmtree(args.outdir)
        with nope_rotary():
            meta = make_reference(twin, args.outdir, load_prompts(DEFAULT_PROMPTS), top_k=TOP_K,
                                  reply_tokens=REPLY_TOKENS, max_tokens=MAX_TOKENS,
                                  repo="sim/tiny-glm BF16 twin", revision=f"seed {args.seed}",
                                  title="tiny-glm quality reference (simulation)")
    with card.open("a") as handle:
        handle.write(f"\nsource: {provenance}\n")
    print(f"wrote {args.outdir}: {meta['windows']} windows, {meta['positions']} positions ({provenance})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
