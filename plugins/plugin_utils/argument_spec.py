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


# libyaml's loader where PyYAML has it: the filters that read the spec run in Ansible's forked workers, each of
# which parses the file anew (0.26 s of a no-op site.yml with the pure-Python loader, py-spy).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@lru_cache(maxsize=1)
def spec_options() -> Mapping[str, Mapping[str, Any]]:
    return yaml.load(SPEC_PATH.read_text(), Loader=_LOADER)["argument_specs"]["main"]["options"]
