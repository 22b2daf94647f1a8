# SPDX-License-Identifier: MIT
"""tools/test-tiers.sh (`make test`): the order its tiers run in, what runs beside what, and that a failing fast
tier stops the run and every tier running beside it, whole process groups included. Real bash and real processes;
`make` is a stand-in on PATH that sleeps and exits as each test tells it, per target."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[3]
FAKE_MAKE = """#!/bin/bash
target=${!#}
echo "$(date +%s.%N) start $target $(chrt -p $$ | awk 'NR == 1 {print $NF}') $*" >> "$TIERS_EVENTS"
# A child that outlives a plain kill of this process: only a kill of the process group ends it.
sleep 300 &
child=$!
echo "$child" >> "$TIERS_CHILDREN"
sleep "$(cat "$TIERS_PLAN/$target.seconds" 2>/dev/null || echo 0.2)"
rc=$(cat "$TIERS_PLAN/$target.rc" 2>/dev/null || echo 0)
echo "$(date +%s.%N) end $target $rc" >> "$TIERS_EVENTS"
kill "$child"
exit "$rc"
"""


def run_tiers(tmp_path: Path, plan: Dict[str, tuple]) -> tuple:
    """Run a copy of test-tiers.sh with the stand-in make; PLAN maps a target to (seconds, exit code)."""
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "tools" / "test-tiers.sh", tmp_path / "tools" / "test-tiers.sh")
    bin_dir, plan_dir = tmp_path / "bin", tmp_path / "plan"
    bin_dir.mkdir()
    plan_dir.mkdir()
    (bin_dir / "make").write_text(FAKE_MAKE)
    (bin_dir / "make").chmod(0o755)
    for target, (seconds, rc) in plan.items():
        (plan_dir / (target + ".seconds")).write_text(str(seconds))
        (plan_dir / (target + ".rc")).write_text(str(rc))
    events, children = tmp_path / "events", tmp_path / "children"
    env = dict(os.environ, PATH="%s:%s" % (bin_dir, os.environ["PATH"]), TIERS_PLAN=str(plan_dir),
               TIERS_EVENTS=str(events), TIERS_CHILDREN=str(children))
    done = subprocess.run(["bash", str(tmp_path / "tools" / "test-tiers.sh")], env=env, capture_output=True,
                          text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)
    lines = events.read_text().splitlines() if events.exists() else []
    order: List[tuple] = [(line.split()[1], line.split()[2], float(line.split()[0])) for line in lines]
    return done, order, children


def started(order: List[tuple]) -> List[str]:
    return [target for what, target, _at in order if what == "start"]


def ended(order: List[tuple]) -> List[str]:
    return [target for what, target, _at in order if what == "end"]


def at(order: List[tuple], what: str, target: str) -> float:
    return next(t for w, name, t in order if w == what and name == target)


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed child waits for its new parent to reap it)."""
    try:
        return Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def alive(children: Path) -> List[int]:
    pids = [int(p) for p in children.read_text().split()] if children.exists() else []
    deadline = time.monotonic() + 5
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if running(pid)]


def start_args(tmp_path: Path, target: str) -> List[str]:
    """The arguments the stand-in make was started with for TARGET (its flags, then the target)."""
    return next(line.split()[4:] for line in (tmp_path / "events").read_text().splitlines()
                if line.split()[1:3] == ["start", target])


def test_the_images_build_beside_the_virtualenv_and_the_cluster_is_made_from_them(tmp_path: Path) -> None:
    done, order, children = run_tiers(tmp_path, {"images": (1.0, 0), "venv": (0.5, 0), "sim-create": (0.3, 0),
                                                 "check": (3.0, 0)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(started(order)[:2]) == ["images", "venv"]
    assert at(order, "start", "images") < at(order, "end", "venv")
    # check needs only the virtualenv; the cluster's making needs both, and does not build the images again.
    assert at(order, "end", "venv") <= at(order, "start", "check") < at(order, "end", "images")
    assert at(order, "start", "sim-create") >= at(order, "end", "images")
    assert start_args(tmp_path, "sim-create") == ["--no-print-directory", "-o", "images", "sim-create"]
    assert "images " in done.stdout.split("time per tier")[1], done.stdout
    assert alive(children) == []


def test_a_failed_virtualenv_stops_the_images_and_starts_nothing_else(tmp_path: Path) -> None:
    done, order, children = run_tiers(tmp_path, {"images": (60, 0), "venv": (0.5, 1)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "failed: venv" in done.stdout and "images stopped" in done.stdout
    assert sorted(started(order)) == ["images", "venv"] and "images" not in ended(order)
    assert alive(children) == []


def test_failed_images_fail_the_run_after_check_and_the_cluster_is_not_made(tmp_path: Path) -> None:
    done, order, _children = run_tiers(tmp_path, {"images": (0.3, 1), "check": (1.5, 0)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "failed: images sim-create" in done.stdout
    assert "images failed: sim-create not started" in done.stdout
    assert sorted(started(order)) == ["check", "images", "venv"] and "check" in ended(order)


def test_molecule_default_starts_once_the_cluster_exists_beside_the_rest_of_check(tmp_path: Path) -> None:
    done, order, children = run_tiers(tmp_path, {"sim-create": (0.5, 0), "check": (4.0, 0),
                                                 "molecule-default-created": (0.5, 0)})
    assert done.returncode == 0, done.stdout + done.stderr
    # images beside venv, then sim-create and check (in either order), molecule default after them.
    assert sorted(started(order)[:2]) == ["images", "venv"]
    assert sorted(started(order)[2:4]) == ["check", "sim-create"] and started(order)[4] == "molecule-default-created"
    # Beside check, not after it.
    assert at(order, "start", "molecule-default-created") < at(order, "end", "check")
    assert at(order, "start", "molecule-default-created") >= at(order, "end", "sim-create")
    # faults after default, four_nodes after faults; the engine tier beside them, in the idle scheduling class.
    assert sorted(started(order)[5:]) == ["engine", "molecule-faults", "molecule-four-nodes"]
    assert at(order, "start", "molecule-faults") >= at(order, "end", "molecule-default-created")
    assert at(order, "start", "molecule-four-nodes") >= at(order, "end", "molecule-faults")
    assert at(order, "start", "engine") >= at(order, "end", "molecule-default-created")
    policies = {line.split()[2]: line.split()[3] for line in (tmp_path / "events").read_text().splitlines()
                if line.split()[1] == "start"}
    assert policies.pop("engine") == "SCHED_IDLE" and set(policies.values()) == {"SCHED_OTHER"}, policies
    for tier in ("venv", "images", "check", "sim-create", "molecule-default-created", "molecule-faults", "engine"):
        assert "%s " % tier in done.stdout.split("time per tier")[1], done.stdout
    assert alive(children) == []


def test_a_failing_check_stops_molecule_default_running_beside_it(tmp_path: Path) -> None:
    done, order, children = run_tiers(tmp_path, {"sim-create": (0.3, 0), "check": (1.5, 2),
                                                 "molecule-default-created": (60, 0)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "molecule-default-created stopped" in done.stdout
    assert "failed: check" in done.stdout
    assert "molecule-faults" not in started(order)
    # Stopped, not waited for: the run ends within seconds of check, and nothing it started is left running.
    assert "molecule-default-created" not in ended(order)
    assert alive(children) == []


def test_a_failing_check_stops_the_cluster_being_made(tmp_path: Path) -> None:
    # check fails once the cluster's making has begun (it starts within a second of the images' end).
    done, order, children = run_tiers(tmp_path, {"sim-create": (60, 0), "check": (2.5, 2)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "sim-create stopped" in done.stdout
    assert sorted(started(order)) == ["check", "images", "sim-create", "venv"]
    assert alive(children) == []


def test_a_failed_cluster_fails_the_run_after_check_and_starts_no_scenario(tmp_path: Path) -> None:
    done, order, _children = run_tiers(tmp_path, {"sim-create": (0.3, 1), "check": (1.0, 0)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "failed: sim-create" in done.stdout
    assert sorted(started(order)) == ["check", "images", "sim-create", "venv"]
    assert "check" in ended(order)
