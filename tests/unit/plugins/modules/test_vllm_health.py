# SPDX-License-Identifier: MIT
"""vllm_health as Ansible runs it: a canary pattern that cannot compile fails before any request."""
from __future__ import annotations

from typing import Any, Callable, Dict

ModuleRunner = Callable[..., Dict[str, Any]]


def test_a_canary_pattern_that_does_not_compile_fails_before_any_request(run_module: ModuleRunner) -> None:
    # Port 9 (discard) on loopback: had the module sent a request, the error would be a connection failure.
    result = run_module("vllm_health", {"url": "http://127.0.0.1:9", "served_model_name": "m", "timeout": 1,
                                        "canary": {"expect_regex": "paris("}})
    assert result["failed"] is True
    assert result["msg"] == ("canary.expect_regex does not compile: missing ), unterminated subpattern at position 5"
                             " in 'paris('")
