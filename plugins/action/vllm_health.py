# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Controller side of ``sparkops.glm53.vllm_health``: progress (elapsed, phase, newest log line of the
head container) while the launch takes up to an hour."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ansible_collections.sparkops.glm53.plugins.plugin_utils.progress_action import ProgressActionBase

# async_wrapper's own limit: the module's timeout plus room for warmup, canary and slow SSH.
ASYNC_MARGIN_S = 900


def progress_line(record: Dict[str, Any], host: str) -> str:
    line = "vllm_health [%s] %4.0fs %s" % (host, float(record.get("elapsed_s", 0)), record.get("phase", "?"))
    last = record.get("last_log_line")
    return line + (" | " + str(last)[:160] if last else "")


class ActionModule(ProgressActionBase):
    always_unchanged = True

    def progress_line(self, record: Dict[str, Any], host: str) -> str:
        return progress_line(record, host)

    # An engine that already serves (a re-run that restarts nothing) is asked in the foreground: one module run
    # instead of a background job, its status polls and its cleanup. One that does not serve yet is waited for
    # in the background as before.
    def foreground_args(self, args: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        return dict(args, wait=False)

    def foreground_done(self, result: Dict[str, Any]) -> bool:
        return bool(result.get("ready"))

    def time_limit(self, args: Dict[str, Any]) -> float:
        return float(args.get("timeout", 3600)) + float(args.get("request_timeout", 600)) * (
            int(args.get("warmup_requests", 1)) + 1) + ASYNC_MARGIN_S
