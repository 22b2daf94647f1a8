# SPDX-License-Identifier: MIT
"""Filter over `docker image inspect` data; documentation in image_layer_key.yml."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.module_utils.image_key import image_layer_key as _key


_REQUIRED = object()


def image_layer_key(image: Any, missing: Any = _REQUIRED) -> str:
    # `missing` lets a caller compare "no image" like any other key instead of failing the task.
    if missing is not _REQUIRED and not image:
        return str(missing)
    try:
        return _key(image)
    except ValueError as exc:
        raise AnsibleFilterError(f"image_layer_key: {exc}") from exc


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"image_layer_key": image_layer_key}
