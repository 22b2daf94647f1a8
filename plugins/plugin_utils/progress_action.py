# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Controller side of long-running modules: run the module in the background on the target and print a
progress line from its progress file every DISPLAY_EVERY_S, instead of a silent task for up to an hour.
Check mode, user-requested ``async`` and connections with their own async support fall back to running
the module plainly. Subclasses say how to print a progress record and how long the job may take, and may name a
quick foreground run to try first (a re-run with nothing to do then costs one module run, not a background job,
its status polls and cleanup)."""
from __future__ import annotations

import base64
import json
import secrets
import time
from typing import Any, Dict, Optional

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

# How soon a finished (or failed) job is noticed: a dead rank must be reported within seconds. The first status
# poll comes sooner and the gap doubles up to STATUS_EVERY_S, so a job done in a second is not waited on for two.
FIRST_STATUS_S = 0.25
STATUS_EVERY_S = 2.0
DISPLAY_EVERY_S = 20.0
ASYNC_KEYS = ("ansible_job_id", "started", "finished", "results_file", "stdout_lines", "stderr_lines")


class ProgressActionBase(ActionBase):
    _supports_check_mode = True
    _supports_async = True
    # vllm_health only observes; a download reports what it changed.
    always_unchanged = False

    def progress_line(self, record: Dict[str, Any], host: str) -> str:
        raise NotImplementedError

    def time_limit(self, args: Dict[str, Any]) -> float:
        raise NotImplementedError

    def foreground_args(self, args: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """Arguments of a quick foreground run tried before the background job; None skips it."""
        return None

    def foreground_done(self, result: Dict[str, Any]) -> bool:
        """Whether the foreground run's result is the task's (else the background job runs)."""
        return True

    def run(self, tmp: Any = None, task_vars: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        result = super().run(tmp, task_vars)
        del tmp
        task_vars = task_vars or {}
        if self._task.check_mode or self._task.async_val or self._connection.has_native_async:
            wrap = bool(self._task.async_val) and not self._connection.has_native_async
            result.update(self._execute_module(task_vars=task_vars, wrap_async=wrap))
            if not wrap:
                self._remove_tmp_path(self._connection._shell.tmpdir)
            return result

        args = dict(self._task.args)
        quick = self.foreground_args(args)
        if quick is not None:
            first = self._execute_module(module_args=quick, task_vars=task_vars)
            if first.get("failed") or self.foreground_done(first):
                self._remove_tmp_path(self._connection._shell.tmpdir)
                result.update(first)
                return result
        own_progress = not args.get("progress_file")
        if own_progress:
            args["progress_file"] = "/tmp/.sparkops-%s-%s.json" % (self._task.action.split(".")[-1],
                                                                   secrets.token_hex(6))
        limit = self.time_limit(args)
        host = task_vars.get("inventory_hostname", "?")

        self._task.async_val = int(limit)
        try:
            started = self._execute_module(module_args=args, task_vars=task_vars, wrap_async=True)
        finally:
            self._task.async_val = 0
        if started.get("failed") or "ansible_job_id" not in started:
            result.update(started)
            return result
        jid = started["ansible_job_id"]
        async_dir = self._remote_expand_user(self.get_shell_option("async_dir", default="~/.ansible_async"))

        final = self._wait(jid, async_dir, args["progress_file"], host, task_vars, limit)
        self._execute_module(module_name="ansible.legacy.async_status", task_vars=task_vars,
                             module_args={"jid": jid, "mode": "cleanup", "_async_dir": async_dir})
        if own_progress:
            self._execute_module(module_name="ansible.legacy.file", task_vars=task_vars,
                                 module_args={"path": args["progress_file"], "state": "absent"})
        self._remove_tmp_path(self._connection._shell.tmpdir)
        for key in ASYNC_KEYS:
            final.pop(key, None)
        if self.always_unchanged:
            final["changed"] = False
        result.update(final)
        return result

    def _wait(self, jid: str, async_dir: str, progress_file: str, host: str, task_vars: Dict[str, Any],
              limit: float) -> Dict[str, Any]:
        start = time.monotonic()
        next_display = start + DISPLAY_EVERY_S
        pause = FIRST_STATUS_S
        while True:
            status = self._execute_module(module_name="ansible.legacy.async_status", task_vars=task_vars,
                                          module_args={"jid": jid, "mode": "status", "_async_dir": async_dir})
            if status.get("finished"):
                return status
            now = time.monotonic()
            if now - start > limit + 60:
                return {"failed": True, "msg": "%s job %s did not finish within %ss" % (self._task.action, jid, limit)}
            if now >= next_display:
                next_display = now + DISPLAY_EVERY_S
                record = self._read_progress(progress_file, task_vars)
                if record is not None:
                    display.display(self.progress_line(record, host))
            time.sleep(pause)
            pause = min(pause * 2, STATUS_EVERY_S)

    def _read_progress(self, path: str, task_vars: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        slurped = self._execute_module(module_name="ansible.legacy.slurp", task_vars=task_vars,
                                       module_args={"src": path})
        if slurped.get("failed") or "content" not in slurped:
            return None
        try:
            record = json.loads(base64.b64decode(slurped["content"]))
        except (ValueError, TypeError):
            return None
        return record if isinstance(record, dict) else None
