# SPDX-License-Identifier: MIT
"""The collection's argument spec (roles/glm53/meta/argument_specs.yml), the one source of every setting's
type, default and choices, as the controller-side plugins read it wherever the collection is installed."""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

# plugins/plugin_utils/ -> the collection's root.
SPEC_PATH = Path(__file__).resolve().parents[2] / "roles" / "glm53" / "meta" / "argument_specs.yml"


@lru_cache(maxsize=1)
def spec_options() -> Mapping[str, Mapping[str, Any]]:
    return yaml.safe_load(SPEC_PATH.read_text())["argument_specs"]["main"]["options"]
