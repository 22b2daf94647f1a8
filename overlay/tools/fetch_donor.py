"""Fetch a donor model's o_proj tensors from Hugging Face for glm53_ablation_method=transplant.

    python overlay/tools/fetch_donor.py OWNER/REPO --layers 15-45 --out /models/donor [--revision REV]

Only the header and each wanted tensor's byte range are read from the checkpoint shards; re-running
skips tensors already in --out with a matching sha256. Uses HF_TOKEN from the environment if set.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from urllib.parse import quote

from glm53_overlay.ablation.donor_fetch import fetch_donor
from glm53_overlay.ablation.settings import AblationSettingError, parse_layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("repo", help="Hugging Face model repo id, e.g. owner/name")
    parser.add_argument("--layers", required=True, help="as glm53_ablation_layers: 15-45 or 1,3,5-7")
    parser.add_argument("--out", required=True, type=Path, help="donor directory (glm53_ablation_donor_dir)")
    parser.add_argument("--revision", default="main", help="branch, tag or commit of the repo")
    args = parser.parse_args(argv)
    try:
        layers = parse_layers(args.layers)
    except AblationSettingError as exc:
        parser.error(str(exc))

    from huggingface_hub import HfFileSystem

    # HfFileSystem paths carry the revision after '@', URL-encoded because branch names may contain '/'.
    root = f"{args.repo}@{quote(args.revision, safe='')}"
    fetched = fetch_donor(HfFileSystem(), root, layers, args.out, {"repo": args.repo, "revision": args.revision})
    print(f"fetched {len(fetched)} of {len(layers)} o_proj tensors into {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
