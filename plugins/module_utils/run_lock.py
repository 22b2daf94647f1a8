# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""The run lock: one directory on the head that serialises site.yml runs against one cluster.

Two launches at once remove each other's rank containers (each sees the other's half-started ranks as
"not matching" and restarts them). The lock is a directory because ``mkdir`` is atomic on every local
file system; ``holder.json`` inside names the run that holds it, so whoever waits can say for whom.
Only the holder's token releases it; a lock is broken only when the caller names the exact holder it
knows to be gone (a run of the same controller whose process has exited).

Pure functions with the clock and sleep passed in, so tests drive them without waiting.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional

HOLDER_FILE = "holder.json"


@dataclass(frozen=True)
class Holder:
    token: str
    owner: str = "?"
    controller: str = ""
    pid: int = 0
    playbook: str = ""
    since: float = 0.0

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
                   playbook=str(data.get("playbook") or ""), since=since)

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


def break_if_held_by(path: str, token: str, now: float) -> bool:
    """Remove the lock only when its holder is exactly ``token`` (a run known to be gone)."""
    state = read_state(path, now)
    if state.held and state.holder is not None and token and state.holder.token == token:
        shutil.rmtree(path, ignore_errors=True)
        return True
    return False


@dataclass(frozen=True)
class AcquireOutcome:
    acquired: bool
    waited_s: float
    state: LockState  # the holder seen last (the one we waited for); empty when the lock was free
    broken: bool = False


def acquire(path: str, holder: Holder, timeout: float, poll_interval: float, break_token: str = "",
            clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> AcquireOutcome:
    """Wait up to ``timeout`` seconds for the lock. ``break_token`` first removes a lock held by that run."""
    start = clock()
    broken = bool(break_token) and break_if_held_by(path, break_token, start)
    seen = LockState(False)
    while True:
        now = clock()
        ok, state = try_acquire(path, holder, now)
        if ok:
            return AcquireOutcome(True, round(now - start, 3), seen if seen.held else state, broken)
        if state.held:
            seen = state
        if now - start >= timeout:
            return AcquireOutcome(False, round(now - start, 3), seen, broken)
        sleep(max(0.01, min(poll_interval, timeout - (now - start))))


def describe_state(state: LockState, now: float) -> str:
    if not state.held:
        return "nobody"
    if state.holder is None:
        return "an unnamed holder (no readable %s, lock %d s old)" % (HOLDER_FILE, int(state.age_s))
    return state.holder.describe(now)
