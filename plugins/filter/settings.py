# SPDX-License-Identifier: MIT
"""The settings filter; documentation in settings_errors.yml."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.sparkops.glm53.plugins.module_utils.settings_rules import settings_errors
from ansible_collections.sparkops.glm53.plugins.plugin_utils.argument_spec import spec_options


def _settings_errors(settings: Mapping[str, Any], also: Sequence[str] = ()) -> list[str]:
    if not isinstance(settings, Mapping):
        raise AnsibleFilterError("settings_errors: expects a mapping of glm53_* settings")
    return settings_errors(settings, spec_options(), also)


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"settings_errors": _settings_errors}
