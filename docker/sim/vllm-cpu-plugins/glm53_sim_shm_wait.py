# SPDX-License-Identifier: MIT
"""Let a simulated rank's engine processes wait for each other without taking the cores they wait for.

vLLM's engine core and its workers pass every step's work and results through shared-memory queues
(`vllm.distributed.device_communicators.shm_broadcast`). A reader that read within the last second, and a writer
whose queue is full, poll the queue in a loop that calls sched_yield: on a GPU host the polling process has a core
to itself and wakes microseconds sooner than it would from a sleep. The simulated cluster runs two to four ranks
and their engine cores on two cores, where sched_yield gives the core away only to a task already waiting for it,
so the pollers took most of both cores while the pair answered requests (docs/simulation.md has the measurement).
With GLM53_SIM_SHM_POLL_SECONDS set, each of those polls sleeps that long instead: the same loop, checking the
queue as often as a sleep of that length allows. Without the variable this plugin changes nothing.

vLLM's own idle path (after a second without a read the reader sleeps on a zmq notification from the writer) is
no substitute: with it always on, a TP=2 engine run here took 17-33 s instead of 12-16, in whole multiples of its
5 s recheck, so some notifications are missed.
"""

from __future__ import annotations

import os
import time

VARIABLE = "GLM53_SIM_SHM_POLL_SECONDS"


def poll_seconds() -> float | None:
    """The variable's value in seconds, None when it is unset; anything but a number > 0 and < 1 is an error."""
    value = os.environ.get(VARIABLE)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 1:  # also false for nan
        raise ValueError("%s must be a number of seconds above 0 and below 1, got %r" % (VARIABLE, value))
    return seconds


def register() -> None:
    """vLLM general plugin: the shared-memory queues of this process sleep where they would call sched_yield."""
    seconds = poll_seconds()
    if seconds is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if getattr(shm_broadcast.sched_yield, "glm53_poll_seconds", None) is not None:
        return

    def sleep_a_poll() -> None:
        time.sleep(seconds)

    setattr(sleep_a_poll, "glm53_poll_seconds", seconds)
    shm_broadcast.sched_yield = sleep_a_poll
