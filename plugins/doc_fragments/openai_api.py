# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Options every module that talks to the served OpenAI-compatible API shares."""
from __future__ import annotations


class ModuleDocFragment:  # pylint: disable=too-few-public-methods
    DOCUMENTATION = r"""
options:
  url:
    description: Base URL of the head's OpenAI-compatible API, as seen from the node the module runs on.
    type: str
    default: http://127.0.0.1:8888
  served_model_name:
    description: The engine's C(--served-model-name); C(/v1/models) must list it and requests send it as C(model).
    type: str
    required: true
  api_key:
    description: "Sent as C(Authorization: Bearer ...) when set."
    type: str
"""
