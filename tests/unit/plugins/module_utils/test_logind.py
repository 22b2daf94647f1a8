# SPDX-License-Identifier: MIT
"""RemoveIPC and lingering: which logind.conf files count and in what order, what RemoveIPC they leave, and
whether the SSH user's IPC objects go when its last session closes (plugins/module_utils/logind.py)."""
from __future__ import annotations

from typing import Dict, List

import pytest
from ansible_collections.sparkops.glm53.plugins.module_utils.logind import (
    DROPIN,
    RemoveIpc,
    config_files,
    judge,
    parse_bool,
    remove_ipc,
)

UBUNTU_MAIN = """#  This file is part of systemd.
[Login]
#NAutoVTs=6
#KillUserProcesses=no
#RemoveIPC=yes
#InhibitDelayMaxSec=5
"""


def tree(files: Dict[str, str]):
    """list_dir and is_file over a dict of path -> text, the way config_files sees a file system."""
    def list_dir(path: str) -> List[str]:
        return [p[len(path) + 1:] for p in files if p.startswith(path + "/") and "/" not in p[len(path) + 1:]]

    return list_dir, files.__contains__


def effective(files: Dict[str, str]) -> RemoveIpc:
    return remove_ipc((path, files[path]) for path in config_files(*tree(files)))


def test_the_commented_out_default_file_leaves_systemds_default_on() -> None:
    setting = effective({"/etc/systemd/logind.conf": UBUNTU_MAIN})
    assert setting.enabled and "default" in setting.source and not setting.warnings


def test_a_drop_in_overrides_the_main_file_and_names_its_line() -> None:
    files = {"/etc/systemd/logind.conf": UBUNTU_MAIN + "RemoveIPC=yes\n",
             "/etc/systemd/logind.conf.d/10-keep.conf": "# keep NCCL's semaphores\n[Login]\nRemoveIPC=no\n"}
    setting = effective(files)
    assert not setting.enabled
    assert setting.source == "RemoveIPC=no in /etc/systemd/logind.conf.d/10-keep.conf:3"


def test_drop_ins_apply_by_file_name_across_directories_and_etc_masks_the_same_name() -> None:
    files = {
        "/usr/lib/systemd/logind.conf.d/20-vendor.conf": "[Login]\nRemoveIPC=no\n",
        "/usr/lib/systemd/logind.conf.d/90-late.conf": "[Login]\nRemoveIPC=no\n",
        "/run/systemd/logind.conf.d/50-mid.conf": "[Login]\nRemoveIPC=yes\n",
        # Same name as the vendor file: this one is read and the vendor one is not.
        "/etc/systemd/logind.conf.d/90-late.conf": "",
        "/etc/systemd/logind.conf.d/README": "[Login]\nRemoveIPC=no\n",  # not *.conf: never read
    }
    assert config_files(*tree(files)) == ["/usr/lib/systemd/logind.conf.d/20-vendor.conf",
                                          "/run/systemd/logind.conf.d/50-mid.conf",
                                          "/etc/systemd/logind.conf.d/90-late.conf"]
    setting = effective(files)
    assert setting.enabled and setting.source == "RemoveIPC=yes in /run/systemd/logind.conf.d/50-mid.conf:2"


def test_the_main_file_is_the_first_found_from_etc_down_and_comes_before_every_drop_in() -> None:
    files = {"/usr/lib/systemd/logind.conf": "[Login]\nRemoveIPC=no\n",
             "/etc/systemd/logind.conf": "[Login]\nRemoveIPC=yes\n",
             "/usr/lib/systemd/logind.conf.d/00-first.conf": "[Login]\nRemoveIPC=no\n"}
    assert config_files(*tree(files)) == ["/etc/systemd/logind.conf", "/usr/lib/systemd/logind.conf.d/00-first.conf"]
    assert not effective(files).enabled


@pytest.mark.parametrize("word,value", [("yes", True), ("On", True), ("1", True), ("t", True), ("y", True),
                                        ("NO", False), ("off", False), ("0", False), ("false", False), ("n", False),
                                        ("nope", None), ("", None), ("2", None)])
def test_booleans_are_the_words_systemd_accepts(word: str, value: object) -> None:
    assert parse_bool(word) is value


def test_assignments_logind_ignores_do_not_count_and_are_reported() -> None:
    text = ("RemoveIPC=no\n"  # before any section
            "[Login]\n"
            "RemoveIPC=nope\n"  # not a boolean
            "removeipc=no\n"  # names are case-sensitive
            "; RemoveIPC=no\n"
            "[Other]\n"
            "RemoveIPC=no\n")
    setting = remove_ipc([("/etc/systemd/logind.conf", text)])
    assert setting.enabled
    assert setting.warnings == (
        "/etc/systemd/logind.conf:1: RemoveIPC outside the [Login] section is ignored",
        "/etc/systemd/logind.conf:3: RemoveIPC=nope is not a boolean and is ignored",
        "/etc/systemd/logind.conf:7: RemoveIPC outside the [Login] section is ignored",
    )


def test_each_file_starts_outside_any_section() -> None:
    files = [("/etc/systemd/logind.conf", "[Login]\nKillUserProcesses=no\n"),
             ("/etc/systemd/logind.conf.d/x.conf", "RemoveIPC=no\n")]
    setting = remove_ipc(files)
    assert setting.enabled and len(setting.warnings) == 1


def test_a_continued_line_and_spaces_around_the_value() -> None:
    setting = remove_ipc([("/etc/systemd/logind.conf", "[Login]\nRemoveIPC = \\\n  no  \n")])
    assert not setting.enabled and setting.source == "RemoveIPC=no in /etc/systemd/logind.conf:3"


ON = RemoveIpc(True, "the default of systemd: no logind.conf sets RemoveIPC")


def verdict(**overrides: object):
    args = dict(host="spark-worker", user="spark", uid=1000, systemd=True, logind=True, setting=ON, lingering=False)
    args.update(overrides)
    return judge(**args)  # type: ignore[arg-type]


def test_a_regular_user_without_lingering_is_at_risk_and_told_both_fixes() -> None:
    result = verdict()
    assert result.status == "at risk"
    assert "spark-worker" in result.problem and "spark (uid 1000)" in result.problem
    assert "sudo loginctl enable-linger spark" in result.problem
    assert f"RemoveIPC=no under [Login] in {DROPIN}" in result.problem
    assert "systemctl restart systemd-logind" in result.problem


def test_lingering_or_removeipc_off_is_safe() -> None:
    assert verdict(lingering=True).status == "safe"
    off = RemoveIpc(False, "RemoveIPC=no in /etc/systemd/logind.conf:3")
    result = verdict(setting=off)
    assert result.status == "safe" and result.reason == off.source and not result.problem


def test_root_and_system_users_are_exempt() -> None:
    assert verdict(user="root", uid=0).status == "exempt"
    assert verdict(user="ollama", uid=999).status == "exempt"
    assert verdict(user="spark", uid=1000).status == "at risk"


def test_no_systemd_or_no_logind_is_not_applicable_even_for_a_regular_user() -> None:
    for result in (verdict(systemd=False, setting=None), verdict(logind=False, setting=None)):
        assert result.status == "not applicable" and not result.problem
    assert "no systemd-logind" in verdict(systemd=False, setting=None).reason


def test_a_missing_setting_for_a_user_that_logind_would_judge_is_a_caller_error() -> None:
    with pytest.raises(ValueError):
        verdict(setting=None)
