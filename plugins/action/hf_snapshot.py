# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Controller side of ``sparkops.glm53.hf_snapshot``: done/total, rate and ETA every 20 s while a
164 GiB checkpoint downloads, instead of a task that is silent for hours."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ansible_collections.sparkops.glm53.plugins.plugin_utils.progress_action import ProgressActionBase

# A download has no natural end; the async job only needs a bound that no real download reaches.
DOWNLOAD_LIMIT_S = 48 * 3600


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return "%.1f %s" % (n, unit)
        n /= 1024
    return "%.1f TiB" % n


def progress_line(record: Dict[str, Any], host: str) -> str:
    done, total = float(record.get("done_bytes", 0)), float(record.get("total_bytes", 0))
    pct = 100.0 * done / total if total else 100.0
    eta = record.get("eta_s")
    eta_text = "?" if eta is None else "%dm%02ds" % divmod(int(eta), 60)
    return "hf_snapshot [%s] %s / %s (%.0f%%) files %s/%s %s/s ETA %s" % (
        host, _size(done), _size(total), pct, record.get("files_done", "?"), record.get("files_total", "?"),
        _size(float(record.get("rate_bps", 0))), eta_text)


class ActionModule(ProgressActionBase):
    def progress_line(self, record: Dict[str, Any], host: str) -> str:
        return progress_line(record, host)

    def time_limit(self, args: Dict[str, Any]) -> float:
        return DOWNLOAD_LIMIT_S

    # A snapshot an earlier run completed is found on disk without the hub: no background job for it.
    def foreground_args(self, args: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        return dict(args, local_only=True)

    def foreground_done(self, result: Dict[str, Any]) -> bool:
        return bool(result.pop("local", False))
