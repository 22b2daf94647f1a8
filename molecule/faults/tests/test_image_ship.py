# SPDX-License-Identifier: MIT
"""The image ship over a link that stops moving: the worker's end (`zstd -dc`, first on the SSH user's PATH)
is replaced by a stand-in that reads nothing, as a stalled link looks from the head. The worker's copy of the
engine image is made to differ (a tiny decoy image tagged with its name) so the head must ship. Each run is
`site.yml --tags engine_image` with a short stall timeout: no rank restarts, seconds plus the ship itself.

- stalling every time: the run fails naming the stall and the worker; the decoy still holds the tag;
- stalling once: the head kills the stalled ship, restarts it, the run passes, and the report line gives the
  time, the bytes and the two attempts.
"""
from __future__ import annotations

import json
import time
from typing import Iterator

import pytest
from conftest import HOSTS, NAMES, SIM_VARS, Sim

WORKER = NAMES[1]
WORKER_IP = HOSTS[WORKER]["glm53_fabric_ip"]
IMAGE = SIM_VARS["glm53_image"]
DECOY = "glm53-ship-decoy:1"
STALLS = "/tmp/glm53-ship-stalls"  # how many more decompressions stall; the stand-in counts it down
PIDS = "/tmp/glm53-ship-stall-pids"
# The SSH user's PATH puts /usr/local/bin before /usr/bin (sshd's default), so this shadows the real zstd.
STAND_IN = "/usr/local/bin/zstd"
STAND_IN_TEXT = """#!/bin/sh
# glm53 faults test (test_image_ship.py): the worker's end of the image ship reads nothing while %(stalls)s > 0.
case " $* " in
  *" -dc "*|*" -d "*)
    left=$(cat %(stalls)s 2>/dev/null || echo 0)
    if [ "$left" -gt 0 ]; then
      echo $((left - 1)) > %(stalls)s
      echo $$ >> %(pids)s
      exec sleep 300
    fi ;;
esac
exec /usr/bin/zstd "$@"
""" % {"stalls": STALLS, "pids": PIDS}
ARGS = ("--tags", "engine_image", "-e", "glm53_image_worker_pull=false", "-e", "glm53_image_ship_stall_timeout=10")


def flat(text: str) -> str:
    """The run's output with YAML's line folding undone, so a long message matches in one piece."""
    return " ".join(text.split())


def image_id(sim: Sim, rank: int, ref: str) -> str:
    return sim.node(rank, "docker", "image", "inspect", "-f", "{{.Id}}", ref).stdout.strip()


def layers(sim: Sim, rank: int) -> list:
    out = sim.node(rank, "docker", "image", "inspect", "-f", "{{json .RootFS.Layers}}", IMAGE).stdout
    return json.loads(out) if out.strip() else []


def stall(sim: Sim, times: int) -> None:
    sim.sh(1, "echo %d > %s && chmod 666 %s" % (times, STALLS, STALLS), check=True)


def end_stalls(sim: Sim) -> None:
    """Stop the stand-ins still sleeping (their `docker image load` then reads an empty stream and fails)."""
    sim.sh(1, "[ -s %s ] && kill $(cat %s) 2>/dev/null; rm -f %s; true" % (PIDS, PIDS, PIDS))


@pytest.fixture(scope="module")
def differing_worker(sim: Sim) -> Iterator[str]:
    """The worker's tag on a decoy and the stalling stand-in installed; the real image restored afterwards."""
    original = image_id(sim, 1, IMAGE)
    assert original, "the worker has no %s; run the default scenario first" % IMAGE
    sim.sh(1, "cd /tmp && echo decoy > glm53-decoy && tar -cf - glm53-decoy | docker import - %s" % DECOY, check=True)
    # /usr/local/bin belongs to root: installing the stand-in is the one step here that needs it.
    sim.sh(1, "cat > %s <<'EOF'\n%sEOF\nchmod 755 %s" % (STAND_IN, STAND_IN_TEXT, STAND_IN), check=True, user="root")
    try:
        yield original
    finally:
        end_stalls(sim)
        sim.sh(1, "rm -f %s %s" % (STAND_IN, STALLS), user="root")
        if image_id(sim, 1, IMAGE) != original:
            sim.node(1, "docker", "tag", original, IMAGE, check=True)
        sim.node(1, "docker", "image", "rm", DECOY)


def test_a_ship_that_stalls_every_time_fails_naming_the_stall_and_leaves_the_old_image(
        sim: Sim, differing_worker: str) -> None:
    sim.node(1, "docker", "tag", DECOY, IMAGE, check=True)
    decoy = image_id(sim, 1, DECOY)
    stall(sim, 99)
    run = sim.site("image-ship-stalls", *ARGS, "-e", "glm53_image_ship_attempts=2", timeout=600)
    end_stalls(sim)
    out = flat(run.output)
    assert run.rc != 0, run.evidence()
    assert "Could not ship the engine image to %s (%s): attempt 1 stalled after" % (WORKER, WORKER_IP) in out, \
        run.evidence()
    assert "attempt 2 stalled after" in out and "no byte moved for 1" in out, run.evidence()
    # (no apostrophe: the YAML callback may print the message single-quoted, doubling it)
    assert "old image is untouched" in out, run.evidence()
    assert "glm53_image_ship_stall_timeout" in out, run.evidence()
    # The loads the stand-ins fed end on an empty stream; give them a moment, then the tag must still be the decoy's.
    time.sleep(3)
    assert image_id(sim, 1, IMAGE) == decoy, "an interrupted ship re-tagged the worker's image"
    print("site.yml --tags engine_image, ship stalling twice: %ss" % run.seconds)


def test_a_ship_that_stalls_once_is_restarted_and_reports_time_bytes_and_attempts(
        sim: Sim, differing_worker: str) -> None:
    sim.node(1, "docker", "tag", DECOY, IMAGE, check=True)
    stall(sim, 1)
    run = sim.site("image-ship-stalls-once", *ARGS, timeout=600)
    end_stalls(sim)
    out = flat(run.output)
    assert run.rc == 0, run.evidence()
    assert "image ship to %s (%s): ok in " % (WORKER, WORKER_IP) in out, run.evidence()
    assert ", 2 attempts; attempt 1 stalled after " in out and "no byte moved for 1" in out, run.evidence()
    assert " raw, " in out and " on the wire (" in out, run.evidence()
    # The role's own check passed (the head's layer key); the layers agree here too.
    assert layers(sim, 1) == layers(sim, 0) != [], run.evidence()
    print("site.yml --tags engine_image, ship stalling once then shipped: %ss" % run.seconds)
