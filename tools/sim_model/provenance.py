"""What a generated simulated checkpoint was made from, so the simulated cluster regenerates it when that changes.

A checkpoint's README.md carries a `generated-by:` line; `--if-changed` on the generators compares it with the
current one and prints "up to date" instead of writing when they match (the sim_cluster role reads that).
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import glm53_overlay.exl3

# The generators, and the EXL3 writer they quantize with: a change in either changes the checkpoints.
GENERATOR_DIRS = (Path(__file__).resolve().parent, Path(glm53_overlay.exl3.__file__).resolve().parent)


def generator_digest() -> str:
    """sha256 over the names and bytes of the generators' Python sources."""
    digest = hashlib.sha256()
    for directory in GENERATOR_DIRS:
        for path in sorted(directory.glob("*.py")):
            digest.update(f"{directory.name}/{path.name}".encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _line(provenance: str) -> str:
    return f"generated-by: {provenance}\n"


def up_to_date(outdir: Path, provenance: str) -> bool:
    card = outdir / "README.md"
    return card.is_file() and _line(provenance) in card.read_text()


def stamp(outdir: Path, provenance: str) -> None:
    with (outdir / "README.md").open("a") as card:
        card.write("\n" + _line(provenance))


def keep_if_up_to_date(outdir: Path, provenance: str) -> bool:
    """True (and says so) when OUTDIR was made by PROVENANCE; else removes it for a clean rewrite."""
    if up_to_date(outdir, provenance):
        print(f"{outdir} is up to date ({provenance})")
        return True
    if outdir.exists():
        shutil.rmtree(outdir)
    return False
