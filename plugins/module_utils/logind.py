# SPDX-License-Identifier: MIT
"""Whether systemd-logind will delete the SSH user's IPC objects when the user's last session closes.

With ``RemoveIPC=yes`` (systemd's default) logind removes every System V semaphore, shared-memory segment and
message queue and every POSIX shared-memory and semaphore file owned by a user once that user's last login
session ends, so an Ansible or ssh session that closes pulls them from under whatever the user still runs
there (the multi-Spark recipe's workers hung this way: ../shared/REFERENCE.md). logind spares a user that
lingers (``loginctl enable-linger``: the user is never garbage-collected, so the clean-up never runs), and
never touches root or system users (systemd's ``uid_is_system()``; logind-user.c, ``user_finalize()``).

Pure: the module reads the files and passes their text in, these functions decide.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# systemd's SYSTEM_UID_MAX as Debian and Ubuntu build it (login.defs SYS_UID_MAX): uids up to this are system users.
SYSTEM_UID_MAX = 999
# Where systemd looks for logind.conf and its drop-ins, highest priority first (systemd.syntax(7),
# "Configuration Directories and Precedence"; older systemd reads the main file from /etc only).
CONFIG_DIRS = ("/etc/systemd", "/run/systemd", "/usr/local/lib/systemd", "/usr/lib/systemd")
LINGER_DIR = "/var/lib/systemd/linger"
DROPIN = "/etc/systemd/logind.conf.d/50-glm53-keep-ipc.conf"
# parse_boolean() in systemd's parse-util.c, compared case-insensitively.
_TRUE = {"1", "yes", "y", "true", "t", "on"}
_FALSE = {"0", "no", "n", "false", "f", "off"}


def config_files(list_dir: Callable[[str], list[str]], is_file: Callable[[str], bool]) -> list[str]:
    """The logind.conf files in the order systemd applies them (a later assignment wins).

    The main file is the first ``logind.conf`` of CONFIG_DIRS; then every ``*.conf`` of the ``logind.conf.d``
    directories sorted by file name, a name in a higher-priority directory hiding the same name lower down (a
    drop-in linked to /dev/null masks one that way). ``list_dir`` returns [] for a directory that is not there.
    """
    main = next((f"{d}/logind.conf" for d in CONFIG_DIRS if is_file(f"{d}/logind.conf")), None)
    dropins: dict[str, str] = {}
    for directory in CONFIG_DIRS:
        for name in list_dir(f"{directory}/logind.conf.d"):
            if name.endswith(".conf") and name not in dropins:
                dropins[name] = f"{directory}/logind.conf.d/{name}"
    return ([main] if main else []) + [dropins[name] for name in sorted(dropins)]


@dataclass(frozen=True)
class RemoveIpc:
    """The RemoveIPC value logind reads, where it comes from, and assignments it would ignore."""

    enabled: bool
    source: str
    warnings: tuple[str, ...] = field(default=())


def parse_bool(value: str) -> bool | None:
    """systemd's boolean words; None for anything else (logind logs it and keeps the value it had)."""
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    return None


def remove_ipc(files: Iterable[tuple[str, str]]) -> RemoveIpc:
    """RemoveIPC after reading ``(path, text)`` in order: the last valid ``RemoveIPC=`` of a ``[Login]`` section.

    Like systemd's parser: ``#`` and ``;`` start comments, a trailing backslash continues a line, names are
    case-sensitive, and each file starts outside any section (an assignment before ``[Login]`` is ignored).
    """
    enabled, source = True, "the default of systemd: no logind.conf sets RemoveIPC"
    warnings: list[str] = []
    for path, text in files:
        section = None
        pending = ""
        for number, raw in enumerate(text.splitlines(), start=1):
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition("=")
            if not sep or key.strip() != "RemoveIPC":
                continue
            where = f"{path}:{number}"
            if section != "Login":
                warnings.append(f"{where}: RemoveIPC outside the [Login] section is ignored")
                continue
            parsed = parse_bool(value)
            if parsed is None:
                warnings.append(f"{where}: RemoveIPC={value.strip()} is not a boolean and is ignored")
                continue
            enabled, source = parsed, f"RemoveIPC={value.strip()} in {where}"
    return RemoveIpc(enabled, source, tuple(warnings))


@dataclass(frozen=True)
class Verdict:
    """``status``: not applicable, exempt, safe or at risk; ``problem`` is set only when at risk."""

    status: str
    reason: str
    problem: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"status": self.status, "reason": self.reason, "problem": self.problem}


def judge(*, host: str, user: str, uid: int, systemd: bool, logind: bool, setting: RemoveIpc | None,
          lingering: bool) -> Verdict:
    """Whether closing ``user``'s last session on ``host`` removes its IPC objects, and the fix when it does."""
    if not systemd:
        return Verdict("not applicable", "not booted with systemd, so no systemd-logind")
    if not logind:
        return Verdict("not applicable", "no systemd-logind installed")
    if uid == 0:
        return Verdict("exempt", f"{user} is root, whose IPC objects logind never removes")
    if uid <= SYSTEM_UID_MAX:
        return Verdict("exempt", f"{user} (uid {uid}) is a system user, whose IPC objects logind never removes")
    if setting is None:
        raise ValueError("setting is needed when logind runs and the user is not exempt")
    if not setting.enabled:
        return Verdict("safe", setting.source)
    if lingering:
        return Verdict("safe", f"{user} lingers ({LINGER_DIR}/{user}), so logind keeps its IPC objects "
                               f"({setting.source})")
    return Verdict("at risk", f"RemoveIPC is on ({setting.source}) and {user} does not linger", (
        f"RemoveIPC: systemd-logind on {host} deletes the semaphores and shared memory of {user} (uid {uid}) "
        f"when its last login session closes ({setting.source}), and {user} does not linger; whatever "
        f"{user} runs there with host IPC loses them when an Ansible or ssh session ends. "
        f"Fix: sudo loginctl enable-linger {user} (at once, no restart), or RemoveIPC=no under [Login] in "
        f"{DROPIN} and then sudo systemctl restart systemd-logind."))
