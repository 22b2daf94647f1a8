# SPDX-License-Identifier: MIT
"""run_lock: the head's lock that serialises site.yml runs (the logic; tests/unit/plugins/modules runs the module)."""
from __future__ import annotations

import errno
import os
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional

import pytest

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


# --------------------------------------------------------------------------- holders that are gone (issue 24)

SUPERVISOR = rl.Holder(token="glm53-self-heal", owner="glm53 self-healing supervisor on spark1",
                       playbook="self-healing recovery", since=1000.0, boot_id="boot-1", container="glm53-self-heal")
# A run of controller "laptop" that recorded the head's boot.
RUN = rl.Holder(token="run-a", owner="alice@laptop pid 4242", controller="laptop", pid=4242, playbook="site.yml",
                since=1000.0, boot_id="boot-1")
HERE = rl.Facts(boot_id="boot-1", controller="laptop", controller_pids=frozenset({4242, 4300}))


def test_a_run_of_this_controller_whose_process_exited_is_gone_and_a_live_one_is_not() -> None:
    gone, why = rl.judge(RUN, replace(HERE, controller_pids=frozenset({4300})))
    assert gone and why == "a run of this controller (laptop) whose process 4242 has exited"
    gone, why = rl.judge(RUN, HERE)
    assert not gone and why == "a run of this controller (laptop) whose process 4242 still runs"


def test_a_live_process_of_this_controller_wins_over_a_changed_boot_id() -> None:
    # The controller is not the head: its run survives the head's reboot and still holds the lock.
    assert not rl.judge(RUN, replace(HERE, boot_id="boot-2"))[0]


def test_a_holder_from_before_the_heads_reboot_is_gone() -> None:
    other = replace(RUN, controller="desk")
    gone, why = rl.judge(other, replace(HERE, boot_id="boot-2"))
    assert gone and why.startswith("the head rebooted since the lock was taken (boot id boot-1 then, boot-2 now)")
    assert not rl.judge(other, HERE)[0]  # same boot: a run of another controller is waited for
    assert not rl.judge(other, replace(HERE, boot_id=""))[0]  # the head's boot id unreadable: cannot tell


@pytest.mark.parametrize("status", ["absent", "exited", "dead", "created", "removing"])
def test_a_supervisor_whose_container_no_longer_runs_is_gone(status: str) -> None:
    gone, why = rl.judge(SUPERVISOR, replace(HERE, container_state=status))
    assert gone and why == "its container glm53-self-heal no longer runs on the head (%s)" % status


@pytest.mark.parametrize("status", ["running", "restarting", "paused"])
def test_a_supervisor_whose_container_runs_or_is_being_restarted_is_live(status: str) -> None:
    # restarting: dockerd's restart policy brings it back, and it breaks its own lock when it starts.
    gone, why = rl.judge(SUPERVISOR, replace(HERE, container_state=status))
    assert not gone and why == "its container glm53-self-heal is %s on the head" % status


def test_a_supervisor_is_live_while_docker_cannot_say() -> None:
    gone, why = rl.judge(SUPERVISOR, replace(HERE, container_error="docker inspect: Cannot connect to the daemon"))
    assert not gone and "cannot tell" in why and "Cannot connect to the daemon" in why


def test_a_supervisor_lock_from_before_a_reboot_is_gone_even_with_its_container_back() -> None:
    # No process survives a reboot; the restarted supervisor takes the lock anew with the new boot id.
    assert rl.judge(SUPERVISOR, replace(HERE, boot_id="boot-2", container_state="running"))[0]
    rebooted = replace(HERE, boot_id="boot-2", container_state="running")
    assert not rl.judge(replace(SUPERVISOR, boot_id="boot-2"), rebooted)[0]


def test_an_old_lock_without_the_new_records_is_judged_as_before() -> None:
    old = rl.Holder.from_dict({"token": "glm53-self-heal", "owner": "glm53 self-healing supervisor",
                               "playbook": "self-healing recovery", "since": 900})
    assert (old.boot_id, old.container) == ("", "")
    assert not rl.judge(old, replace(HERE, boot_id="boot-2", container_state="absent"))[0]
    assert not rl.judge(None, HERE)[0]  # unnamed holder
    # A run of this controller is still judged by its process, as before.
    legacy_run = rl.Holder.from_dict({"token": "r", "controller": "laptop", "pid": 77})
    assert rl.judge(legacy_run, HERE)[0]
    assert not rl.judge(legacy_run, replace(HERE, controller_pids=None))[0]  # the caller did not look


def test_new_records_round_trip_through_holder_json(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, SUPERVISOR, 1000.0)
    assert rl.read_state(path, 1001.0).holder == SUPERVISOR


@pytest.mark.parametrize("rc,out,err,expected", [
    (0, "running\n", "", "running"),
    (0, "exited", "", "exited"),
    (1, "", "Error: No such object: glm53-self-heal", "absent"),
    (1, "", "Error response from daemon: No such container: glm53-self-heal", "absent"),
    (1, "", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock.", None),
    (127, "", "docker: not found", None),
])
def test_container_status_tells_absent_from_unknown(rc: int, out: str, err: str, expected: Optional[str]) -> None:
    assert rl.container_status(rc, out, err) == expected


def test_read_boot_id(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("0b7e1c8a-1f7b-4d6c-9a1e-2b3c4d5e6f70\n")
    assert rl.read_boot_id(str(boot)) == "0b7e1c8a-1f7b-4d6c-9a1e-2b3c4d5e6f70"
    assert rl.read_boot_id(str(tmp_path / "missing")) == ""


def verdict_with(state: Dict[str, Optional[str]]):
    """judge() with the container's state read from ``state`` at each call, as the module reads docker."""
    def verdict(holder: Optional[rl.Holder]) -> tuple:
        return rl.judge(holder, replace(HERE, container_state=state["container"]))
    return verdict


def test_acquire_breaks_a_gone_supervisors_lock_without_waiting(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, SUPERVISOR, 1000.0)
    clock = Clock()
    outcome = rl.acquire(path, SECOND, timeout=1800, poll_interval=2, clock=clock, sleep=clock.sleep,
                         verdict=verdict_with({"container": "absent"}))
    assert outcome.acquired and outcome.broken and outcome.waited_s == 0 and clock.sleeps == []
    assert outcome.why == "its container glm53-self-heal no longer runs on the head (absent)"
    assert outcome.state.holder == SUPERVISOR and rl.read_state(path, clock.now).holder == SECOND


def test_acquire_waits_for_a_live_supervisor_and_says_why(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, SUPERVISOR, 1000.0)
    clock = Clock()
    outcome = rl.acquire(path, SECOND, timeout=6, poll_interval=2, clock=clock, sleep=clock.sleep,
                         verdict=verdict_with({"container": "running"}))
    assert not outcome.acquired and not outcome.broken and outcome.waited_s == 6
    assert outcome.why == "its container glm53-self-heal is running on the head"
    assert rl.read_state(path, clock.now).holder == SUPERVISOR


def test_a_holder_that_dies_while_waited_for_is_broken_then(tmp_path: Path) -> None:
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, SUPERVISOR, 1000.0)
    clock = Clock()
    container: Dict[str, Optional[str]] = {"container": "running"}

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 1004:
            container["container"] = "absent"  # `docker rm -f glm53-self-heal` mid-recovery

    outcome = rl.acquire(path, SECOND, timeout=1800, poll_interval=2, clock=clock, sleep=sleep,
                         verdict=verdict_with(container))
    assert outcome.acquired and outcome.broken and outcome.waited_s == 4
    assert rl.read_state(path, clock.now).holder == SECOND


def test_breaking_spares_a_lock_the_same_token_took_anew(tmp_path: Path) -> None:
    # The supervisor's token is fixed: a restarted supervisor may have taken the lock since it was judged gone.
    path = str(tmp_path / "run.lock")
    rl.try_acquire(path, replace(SUPERVISOR, since=2000.0, boot_id="boot-2"), 2000.0)
    assert not rl.break_if_held_by(path, SUPERVISOR.token, 2001.0, expected=SUPERVISOR)
    assert rl.read_state(path, 2001.0).held
    anew = replace(SUPERVISOR, since=2000.0, boot_id="boot-2")
    assert rl.break_if_held_by(path, SUPERVISOR.token, 2001.0, expected=anew)


# --------------------------------------------------------------------------- the real cause when it cannot be made


def root_dir(_path: str) -> os.stat_result:
    # A directory dockerd created: root's, 0755 (the stat is injected so the test means the same run as any user).
    return os.stat_result((stat.S_IFDIR | 0o755, 1, 1, 2, 0, 0, 4096, 0, 0, 0))


def test_a_lock_that_cannot_be_made_names_the_directory_its_owner_and_the_fix() -> None:
    lock = "/home/spark/.cache/glm53/run.lock"
    seen: List[str] = []

    def stat_of(path: str) -> os.stat_result:
        seen.append(path)
        return root_dir(path)

    exc = PermissionError(errno.EACCES, "Permission denied", lock)
    text = rl.explain_os_error(lock, exc, 1000, "spark", stat=stat_of)
    assert seen == ["/home/spark/.cache/glm53"]
    assert text.startswith("cannot create the run lock %s: permission denied on /home/spark/.cache/glm53 "
                           "(owned by uid 0" % lock)
    assert "mode 755; this run is uid 1000 (spark))" in text and "as root" in text
    assert text.endswith("Fix: sudo chown -R spark /home/spark/.cache/glm53")
    assert "nobody" not in text


def test_a_missing_cache_under_a_root_owned_parent_names_that_parent() -> None:
    exc = PermissionError(errno.EACCES, "Permission denied", "/home/spark/.cache/glm53")
    text = rl.explain_os_error("/home/spark/.cache/glm53/run.lock", exc, 1000, "spark", stat=root_dir)
    assert "permission denied on /home/spark/.cache (" in text and text.endswith("sudo chown -R spark /home/spark/.cache")


def test_other_errors_are_reported_as_they_are() -> None:
    exc = NotADirectoryError(errno.ENOTDIR, "Not a directory", "/x/run.lock")
    assert rl.explain_os_error("/x/run.lock", exc, 1000, "spark") == (
        "cannot create the run lock /x/run.lock: [Errno 20] Not a directory: '/x/run.lock'")
