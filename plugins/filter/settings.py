# SPDX-License-Identifier: MIT
"""The settings filter; documentation in settings_errors.yml."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.module_utils.settings_rules import settings_errors

# The collection's own spec, wherever the collection is installed: plugins/filter/ -> collection root.
_SPEC = Path(__file__).resolve().parents[2] / "roles" / "glm53" / "meta" / "argument_specs.yml"


@lru_cache(maxsize=1)
def _spec_options() -> Mapping[str, Mapping[str, Any]]:
    return yaml.safe_load(_SPEC.read_text())["argument_specs"]["main"]["options"]


def _settings_errors(settings: Mapping[str, Any], also: Sequence[str] = ()) -> list[str]:
    if not isinstance(settings, Mapping):
        raise AnsibleFilterError("settings_errors: expects a mapping of glm53_* settings")
    errors = settings_errors(settings, _spec_options())
    # A setting refused here is not reported a second time by another check's message.
    named = {message.split()[0].rstrip(":") for message in errors}
    return errors + [m for m in also if m.split()[0].rstrip(":") not in named]


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"settings_errors": _settings_errors}
