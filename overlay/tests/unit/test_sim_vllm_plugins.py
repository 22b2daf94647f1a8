"""The simulation's vLLM plugin that stops the engine processes' shared-memory queues from spinning
(docker/sim/vllm-cpu-plugins/glm53_sim_shm_wait.py), against vLLM's own MessageQueue."""
from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable

import glm53_sim_shm_wait
import pytest
from vllm.distributed.device_communicators import shm_broadcast

WAIT = 0.5  # seconds the reader waits for the writer's second message


@pytest.fixture(autouse=True)
def _restore_sched_yield(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_broadcast, "sched_yield", shm_broadcast.sched_yield)
    monkeypatch.delenv(glm53_sim_shm_wait.VARIABLE, raising=False)


def reader_blocks_while_waiting() -> int:
    """How often a reader's thread blocks (gives up its core until woken) while it waits WAIT s for a message, a
    moment after its last read: an engine core waiting for its worker's next result, or a worker for the next
    step. A spinning reader (sched_yield) never blocks however busy the machine is, so the count tells the two
    apart where CPU time does not: on a loaded machine a spinner gets little CPU too."""
    writer = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1)
    reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=writer.wait_until_ready)
    ready.start()
    reader.wait_until_ready()
    ready.join()
    got: dict[str, object] = {}

    def read() -> None:
        start = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        got["message"] = reader.dequeue(timeout=10)
        got["blocks"] = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - start

    writer.enqueue("first")
    read()
    thread = threading.Thread(target=read)
    thread.start()
    time.sleep(WAIT)
    writer.enqueue("second")
    thread.join()
    assert got["message"] == "second"
    return int(got["blocks"])  # type: ignore[call-overload]


def test_a_waiting_reader_sleeps_between_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    spinning = reader_blocks_while_waiting()
    monkeypatch.setenv(glm53_sim_shm_wait.VARIABLE, "0.0005")
    glm53_sim_shm_wait.register()
    polling = reader_blocks_while_waiting()
    # Polls every 0.5 ms: about a thousand blocks in 0.5 s, fewer on a loaded machine (767-867 measured idle and
    # beside six busy loops, 2026-12-07); vLLM's spinning reader 0-1. CPU time told them apart only on an idle
    # machine (CI once saw 0.016 CPU-s spinning against 0.028 polling).
    assert polling >= 50, (polling, spinning)
    assert spinning <= 5, "vLLM's reader no longer spins: the plugin may be unneeded (%s, %s)" % (spinning, polling)


def test_registering_twice_wraps_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(glm53_sim_shm_wait.VARIABLE, "0.002")
    glm53_sim_shm_wait.register()
    first: Callable[[], None] = shm_broadcast.sched_yield
    glm53_sim_shm_wait.register()
    assert shm_broadcast.sched_yield is first
    start = time.monotonic()
    first()
    assert time.monotonic() - start >= 0.002


def test_without_the_variable_nothing_changes() -> None:
    vllms = shm_broadcast.sched_yield
    glm53_sim_shm_wait.register()
    assert shm_broadcast.sched_yield is vllms


@pytest.mark.parametrize("value", ["0", "1", "-0.001", "nan", "half a millisecond", ""])
def test_a_value_out_of_range_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(glm53_sim_shm_wait.VARIABLE, value)
    with pytest.raises(ValueError, match="GLM53_SIM_SHM_POLL_SECONDS must be a number of seconds above 0 and below 1"):
        glm53_sim_shm_wait.register()
