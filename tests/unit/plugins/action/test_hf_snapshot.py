"""Progress lines the controller prints while long modules run in the background."""
from __future__ import annotations

from ansible_collections.sparkops.glm53.plugins.action.hf_snapshot import progress_line as download_line
from ansible_collections.sparkops.glm53.plugins.action.hf_snapshot import ActionModule as DownloadAction


def test_download_line_shows_done_total_rate_and_eta() -> None:
    record = {"done_bytes": 10 * 2**30, "total_bytes": 164 * 2**30, "files_done": 7, "files_total": 120,
              "rate_bps": 100 * 2**20, "eta_s": 1577.0}
    assert download_line(record, "spark-head") == (
        "hf_snapshot [spark-head] 10.0 GiB / 164.0 GiB (6%) files 7/120 100.0 MiB/s ETA 26m17s")


def test_download_line_without_rate_has_unknown_eta() -> None:
    line = download_line({"done_bytes": 0, "total_bytes": 100, "eta_s": None}, "h")
    assert line.endswith("ETA ?") and "(0%)" in line


def test_download_reports_its_own_changed() -> None:
    assert DownloadAction.always_unchanged is False


def test_the_download_tries_the_snapshot_on_disk_first_and_runs_the_job_only_without_one() -> None:
    action = DownloadAction.__new__(DownloadAction)
    wanted = {"repo_id": "o/r", "refresh": False, "local_only": True}
    assert action.foreground_args({"repo_id": "o/r", "refresh": False}) == wanted
    found = {"local": True, "repo_id": "o/r", "changed": False}
    assert action.foreground_done(found) and "local" not in found
    assert not action.foreground_done({"local": False, "changed": False})
