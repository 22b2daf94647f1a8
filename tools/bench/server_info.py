"""What the server was launched with, as far as a client can know it.

vLLM does not publish its speculative config over HTTP, so the playbook passes the head's rendered
``vllm serve`` argv in a JSON file (--server-info); without it only the presence of the spec-decode
counters in /metrics says that speculation is on.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def load_server_info(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def serve_argv(info: Mapping[str, Any] | None) -> list[str] | None:
    argv = (info or {}).get("serve_argv")
    if isinstance(argv, Sequence) and not isinstance(argv, str) and all(isinstance(a, str) for a in argv):
        return list(argv)
    return None


def spec_config(info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The --speculative-config of the serve argv (either ``--flag value`` or ``--flag=value``)."""
    explicit = (info or {}).get("speculative_config")
    if isinstance(explicit, dict):
        return explicit
    argv = serve_argv(info) or []
    for i, arg in enumerate(argv):
        value = None
        if arg == "--speculative-config" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--speculative-config="):
            value = arg.split("=", 1)[1]
        if value is not None:
            parsed = json.loads(value)
            return parsed if isinstance(parsed, dict) else None
    return None
