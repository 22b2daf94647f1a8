# SPDX-License-Identifier: MIT
"""What the module tests share: running a module file the way Ansible's module runner does."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional

import pytest

REPO = Path(__file__).resolve().parents[4]
ModuleRunner = Callable[..., Dict[str, Any]]


@pytest.fixture
def run_module() -> ModuleRunner:
    """``run_module(name, args, check=False, env=None)`` returns the module's JSON result.

    The arguments go in on stdin as Ansible passes them, minus the AnsiballZ wrapper; the collection imports
    through .collections, as it does for ansible-playbook in this checkout.
    """
    def run(name: str, args: Mapping[str, Any], check: bool = False,
            env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
        payload = dict(args)
        if check:
            payload["_ansible_check_mode"] = True
        full_env = dict(os.environ, PYTHONPATH=str(REPO / ".collections"), **(env or {}))
        proc = subprocess.run([sys.executable, str(REPO / "plugins" / "modules" / f"{name}.py")],
                              input=json.dumps({"ANSIBLE_MODULE_ARGS": payload}).encode(), capture_output=True,
                              env=full_env, timeout=60, check=False)
        assert proc.stdout, proc.stderr.decode()
        return json.loads(proc.stdout)

    return run
