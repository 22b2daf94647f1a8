# SPDX-License-Identifier: MIT
"""run_lock: the head's lock that serialises site.yml runs (the logic; tests/unit/plugins/modules runs the module)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import List

from ansible_collections.sparkops.glm53.plugins.module_utils import run_lock as rl

FIRST = rl.Holder(token="run-a", owner="alice@laptop pid 4242", controller="laptop", pid=4242,
                  playbook="site.yml", since=1000.0)
SECOND = rl.Holder(token="run-b", owner="bob@desk pid 7", controller="desk", pid=7, playbook="site.yml")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: List[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_first_run_takes_the_lock_and_names_itself(tmp_path: Path) -> None:
    path = str(tmp_path / "cache" / "run.lock")
    ok, found = rl.try_acquire(path, FIRST, 1000.0)
    assert ok and not found.held
    state = rl.read_state(path, 1010.0)
    assert state.held and state.holder == FIRST
    assert rl.describe_state(state, 1093.0) == (
        "alice@laptop pid 4242 running site.yml since 1970-01-01 00:16:40 UTC (93 s ago)")


def test_second_run_is_refused_and_sees_the_holder(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, FIRST, 1000.0)
    ok, found = rl.try_acquire(path, SECOND, 1001.0)
    assert not ok and found.holder == FIRST


def test_taking_a_lock_already_ours_succeeds(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, FIRST, 1000.0)
    assert rl.try_acquire(path, FIRST, 1005.0)[0]


def test_acquire_waits_then_times_out_naming_the_holder(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, FIRST, 1000.0)
    clock = Clock()
    outcome = rl.acquire(path, SECOND, timeout=10, poll_interval=3, clock=clock, sleep=clock.sleep)
    assert not outcome.acquired and outcome.waited_s == 10 and outcome.state.holder == FIRST
    assert clock.sleeps == [3, 3, 3, 1]  # never sleeps past the timeout
    assert rl.read_state(path, clock.now).holder == FIRST  # the holder's lock is untouched


def test_acquire_gets_the_lock_once_the_holder_releases(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, FIRST, 1000.0)
    clock = Clock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 1006:
            assert rl.release(path, "run-a", clock.now) == "released"

    outcome = rl.acquire(path, SECOND, timeout=60, poll_interval=2, clock=clock, sleep=sleep)
    assert outcome.acquired and outcome.waited_s == 6 and outcome.state.holder == FIRST
    assert rl.read_state(path, clock.now).holder == SECOND


def test_release_only_by_the_holder(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    assert rl.release(path, "run-a", 0) == "absent"
    rl.try_acquire(path, FIRST, 1000.0)
    assert rl.release(path, "run-b", 1001.0) == "not ours"
    assert os.path.isdir(path)
    assert rl.release(path, "run-a", 1002.0) == "released"
    assert not os.path.exists(path)


def test_break_only_the_named_run(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, FIRST, 1000.0)
    assert not rl.break_if_held_by(path, "run-x", 1001.0)
    assert not rl.break_if_held_by(path, "", 1001.0)
    clock = Clock()
    outcome = rl.acquire(path, SECOND, timeout=0, poll_interval=1, break_token="run-a", clock=clock,
                         sleep=clock.sleep)
    assert outcome.acquired and outcome.broken


def test_a_lock_without_holder_file_is_held_by_an_unnamed_run(tmp_path: Path) -> None:
    path = tmp_path / "run.lock"
    path.mkdir()
    state = rl.read_state(str(path), time.time() + 30)
    assert state.held and state.holder is None and state.age_s >= 29
    assert rl.describe_state(state, 0).startswith("an unnamed holder (no readable holder.json")
    assert rl.release(str(path), "run-a", 0) == "not ours"
    (path / "holder.json").write_text("{not json")
    assert rl.read_state(str(path), 0).holder is None


def test_holder_from_a_damaged_record() -> None:
    holder = rl.Holder.from_dict({"token": "t", "pid": "x", "since": None})
    assert (holder.token, holder.pid, holder.since, holder.owner) == ("t", 0, 0.0, "?")
    assert rl.Holder.from_dict(FIRST.to_dict()) == FIRST


def test_only_one_of_many_concurrent_runs_gets_the_lock(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    winners: List[str] = []
    barrier = threading.Barrier(8)

    def contend(i: int) -> None:
        barrier.wait()
        if rl.try_acquire(path, rl.Holder(token="run-%d" % i), time.time())[0]:
            winners.append("run-%d" % i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1 and rl.read_state(path, time.time()).holder.token == winners[0]
