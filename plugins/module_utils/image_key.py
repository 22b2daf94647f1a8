# SPDX-License-Identifier: MIT
"""Identity of an engine image that survives save/load and differing storage drivers.

Image IDs and RepoDigests change when an image is exported and loaded elsewhere; the ordered list of
layer diff-IDs does not, so the key is a digest over that list.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any


def image_layer_key(image: Any) -> str:
    """`sha256:<hex>` over RootFS.Layers of `docker image inspect` output (a dict, or a list of them)."""
    if isinstance(image, Sequence) and not isinstance(image, (str, bytes)):
        if not image:
            raise ValueError("no image to key: the inspect result is an empty list (image not present?)")
        image = image[0]
    if not isinstance(image, Mapping):
        raise ValueError(f"expected the dict of `docker image inspect`, got {type(image).__name__}")
    rootfs = image.get("RootFS")
    layers = rootfs.get("Layers") if isinstance(rootfs, Mapping) else None
    tags = image.get("RepoTags") or []
    name = tags[0] if tags else image.get("Id") or "the image"
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{name} has no RootFS.Layers in its inspect data; cannot key it")
    if not all(isinstance(layer, str) and layer for layer in layers):
        raise ValueError(f"{name} has a malformed RootFS.Layers entry")
    # Joined with newlines so that no two different layer lists hash the same bytes.
    return "sha256:" + hashlib.sha256("\n".join(layers).encode("utf-8")).hexdigest()
