# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""The run lock: one directory on the head that serialises site.yml runs against one cluster.

Two launches at once remove each other's rank containers (each sees the other's half-started ranks as
"not matching" and restarts them). The lock is a directory because ``mkdir`` is atomic on every local
file system; ``holder.json`` inside names the run that holds it, so whoever waits can say for whom.
Only the holder's token releases it. A lock is broken only when its holder is provably gone (``judge``):
a run of the same controller whose process has exited, a holder from before the head's last reboot, or a
holder whose container (the self-healing supervisor's) no longer runs. Anything else is waited for.

Pure functions with the clock, sleep and observed facts passed in, so tests drive them without waiting.
"""
from __future__ import annotations

import errno
import json
import os
import pwd
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, FrozenSet, Mapping, Optional

HOLDER_FILE = "holder.json"
# The kernel's id of this boot: a holder that recorded another one was taken before the last reboot.
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# docker inspect's State.Status values of a container whose process can still hold the lock. "restarting"
# counts: its restart policy brings it back, and a supervisor breaks its own token's lock when it starts.
LIVE_CONTAINER_STATES = frozenset({"running", "restarting", "paused"})


@dataclass(frozen=True)
class Holder:
    token: str
    owner: str = "?"
    controller: str = ""
    pid: int = 0
    playbook: str = ""
    since: float = 0.0
    # The head's boot id when the lock was taken, and the container whose process holds it (the supervisor's);
    # empty in locks taken before these fields existed, which are judged as before.
    boot_id: str = ""
    container: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Holder":
        try:
            pid = int(data.get("pid") or 0)
        except (TypeError, ValueError):
            pid = 0
        try:
            since = float(data.get("since") or 0.0)
        except (TypeError, ValueError):
            since = 0.0
        return cls(token=str(data.get("token") or ""), owner=str(data.get("owner") or "?"),
                   controller=str(data.get("controller") or ""), pid=pid,
                   playbook=str(data.get("playbook") or ""), since=since,
                   boot_id=str(data.get("boot_id") or ""), container=str(data.get("container") or ""))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self, now: float) -> str:
        text = self.owner
        if self.playbook:
            text += " running %s" % self.playbook
        if self.since:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
            text += " since %s (%d s ago)" % (stamp, max(0, int(now - self.since)))
        return text


@dataclass(frozen=True)
class LockState:
    """What is at the lock path: nothing, a named holder, or a directory without (readable) holder.json."""

    held: bool
    holder: Optional[Holder] = None
    age_s: float = 0.0


def holder_path(path: str) -> str:
    return os.path.join(path, HOLDER_FILE)


def read_state(path: str, now: float) -> LockState:
    if not os.path.isdir(path):
        return LockState(False)
    try:
        age = max(0.0, now - os.stat(path).st_mtime)
    except OSError:
        return LockState(False)
    try:
        with open(holder_path(path), encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return LockState(True, None, age)
    return LockState(True, Holder.from_dict(data) if isinstance(data, dict) else None, age)


def _write_holder(path: str, holder: Holder) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".holder-", dir=path)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(holder.to_dict(), handle)
    os.replace(tmp, holder_path(path))


def try_acquire(path: str, holder: Holder, now: float) -> tuple[bool, LockState]:
    """Take the lock if it is free (or already ours). Returns (acquired, what was found)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        state = read_state(path, now)
        # Ours already (a re-entrant take); a lock released between mkdir and the read is retried next poll.
        return bool(state.held and state.holder is not None and state.holder.token == holder.token), state
    _write_holder(path, holder)
    return True, LockState(False)


def release(path: str, token: str, now: float) -> str:
    """Remove the lock if ``token`` holds it: "released", "absent" or "not ours" (left alone)."""
    state = read_state(path, now)
    if not state.held:
        return "absent"
    if state.holder is None or state.holder.token != token:
        return "not ours"
    shutil.rmtree(path, ignore_errors=True)
    return "released"


def break_if_held_by(path: str, token: str, now: float, expected: Optional[Holder] = None) -> bool:
    """Remove the lock only when its holder is exactly ``token`` (a run known to be gone).

    With ``expected``, only when the holder is still that very record: the supervisor's token is fixed, and
    a supervisor restarted meanwhile may have taken the lock anew (another ``since``/``boot_id``).
    """
    state = read_state(path, now)
    if not (state.held and state.holder is not None and token and state.holder.token == token):
        return False
    if expected is not None and state.holder != expected:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def read_boot_id(path: str = BOOT_ID_PATH) -> str:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except (OSError, ValueError):
        return ""


def container_status(rc: int, out: str, err: str) -> Optional[str]:
    """``docker inspect -f '{{.State.Status}}' NAME`` as a state: "absent", the status, or None (cannot tell:
    the daemon did not answer, the CLI is missing)."""
    if rc == 0 and out.strip():
        return out.strip().lower()
    if rc != 0 and "no such" in (err + out).lower():
        return "absent"
    return None


@dataclass(frozen=True)
class Facts:
    """What the taker observed, on the head and on its controller. None/empty: not known."""

    boot_id: str = ""  # the head's now
    controller: str = ""  # this run's controller
    # Processes running Ansible on that controller now; None when the caller did not look.
    controller_pids: Optional[FrozenSet[int]] = None
    # The holder's container as container_status() read it; None when unknown or not looked at.
    container_state: Optional[str] = None
    container_error: str = ""


def judge(holder: Optional[Holder], facts: Facts) -> tuple[bool, str]:
    """(gone, why): whether the holder is provably gone, and the case as a sentence for the run's output.

    Evidence that the holder lives comes first: a live process of this controller wins over a changed boot id
    (the controller is not the head). Without evidence either way the holder is live: waiting is safe,
    breaking a live run's lock is not.
    """
    if holder is None:
        return False, "the holder is unnamed (no readable %s): nothing tells whether it still runs" % HOLDER_FILE
    if holder.controller and holder.controller == facts.controller and holder.pid > 0 \
            and facts.controller_pids is not None:
        if holder.pid in facts.controller_pids:
            return False, "a run of this controller (%s) whose process %d still runs" % (holder.controller, holder.pid)
        return True, "a run of this controller (%s) whose process %d has exited" % (holder.controller, holder.pid)
    if holder.boot_id and facts.boot_id and holder.boot_id != facts.boot_id:
        return True, "the head rebooted since the lock was taken (boot id %s then, %s now)" % (
            holder.boot_id[:8], facts.boot_id[:8])
    if holder.container:
        if facts.container_state is None:
            return False, "cannot tell whether its container %s still runs (%s)" % (
                holder.container, facts.container_error or "not inspected")
        if facts.container_state in LIVE_CONTAINER_STATES:
            return False, "its container %s is %s on the head" % (holder.container, facts.container_state)
        return True, "its container %s no longer runs on the head (%s)" % (holder.container, facts.container_state)
    if holder.controller and holder.controller != facts.controller:
        return False, "a run of another controller (%s), which this one cannot see" % holder.controller
    return False, "nothing shows that it has ended"


@dataclass(frozen=True)
class AcquireOutcome:
    acquired: bool
    waited_s: float
    state: LockState  # the holder seen last (the one we waited for, or broke); empty when the lock was free
    broken: bool = False
    why: str = ""  # judge()'s verdict on that holder: why it was broken, or why it was waited for


def acquire(path: str, holder: Holder, timeout: float, poll_interval: float, break_token: str = "",
            clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
            verdict: Optional[Callable[[Optional[Holder]], tuple[bool, str]]] = None) -> AcquireOutcome:
    """Wait up to ``timeout`` seconds for the lock. ``break_token`` first removes a lock held by that run.

    ``verdict`` (judge() with the caller's facts) is asked about each holder seen, on every poll, so a holder
    that dies while we wait is broken then; a gone holder is removed only while it is still that same record.
    """
    start = clock()
    broken = bool(break_token) and break_if_held_by(path, break_token, start)
    seen = LockState(False)
    why = ""
    while True:
        now = clock()
        ok, state = try_acquire(path, holder, now)
        if ok:
            return AcquireOutcome(True, round(now - start, 3), seen if seen.held else state, broken, why)
        if state.held:
            seen = state
            if verdict is not None:
                gone, why = verdict(state.holder)
                if gone and state.holder is not None and break_if_held_by(path, state.holder.token, now, state.holder):
                    broken = True
                    continue
        if now - start >= timeout:
            return AcquireOutcome(False, round(now - start, 3), seen, broken, why)
        sleep(max(0.01, min(poll_interval, timeout - (now - start))))


def explain_os_error(path: str, exc: OSError, uid: int, user: str,
                     stat: Callable[[str], os.stat_result] = os.stat) -> str:
    """Why the lock at ``path`` could not be made, naming the real cause and its fix.

    The usual one: a folder of the cache that dockerd created, as root, for a bind mount, so the SSH user
    cannot create the lock in it. Said plainly, instead of a wait for a holder that is nobody.
    """
    if exc.errno not in (errno.EACCES, errno.EPERM):
        return "cannot create the run lock %s: %s" % (path, exc)
    # The directory that refused is the parent of what was being created (the lock, or a missing parent).
    denier = os.path.dirname(os.path.abspath(str(exc.filename or path)))
    try:
        info = stat(denier)
    except OSError as stat_exc:
        owner, root_owned = "cannot stat it: %s" % stat_exc.strerror, False
    else:
        owner = "owned by uid %d%s, mode %03o" % (info.st_uid, _user_suffix(info.st_uid), info.st_mode & 0o7777)
        root_owned = info.st_uid == 0 and uid != 0
    why = " dockerd creates a bind mount's missing folders as root." if root_owned else ""
    return "cannot create the run lock %s: permission denied on %s (%s; this run is uid %d%s).%s Fix: %s" % (
        path, denier, owner, uid, " (%s)" % user if user else "", why, "sudo chown -R %s %s" % (user or uid, denier))


def _user_suffix(uid: int) -> str:
    try:
        return " (%s)" % pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def describe_state(state: LockState, now: float) -> str:
    if not state.held:
        return "nobody"
    if state.holder is None:
        return "an unnamed holder (no readable %s, lock %d s old)" % (HOLDER_FILE, int(state.age_s))
    return state.holder.describe(now)
