"""The simulation's vLLM plugin that lets a worker end at the executor's SIGTERM
(docker/sim/vllm-cpu-plugins/glm53_sim_worker_exit.py): a real gloo collective blocks a worker's main thread, as
in a simulated rank whose peer stopped first, and vLLM's own SIGTERM handler never runs there."""
from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import glm53_sim_worker_exit
import pytest
import torch
import torch.distributed as dist
from vllm.v1.executor.multiproc_executor import WorkerProc

FORK = multiprocessing.get_context("fork")
SIGTERM_GRACE_S = 3.0  # how long a worker is given to end after SIGTERM (vLLM's executor waits 4 s)


@pytest.fixture(autouse=True)
def _restore_busy_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WorkerProc, "worker_busy_loop", WorkerProc.worker_busy_loop)
    monkeypatch.delenv(glm53_sim_worker_exit.VARIABLE, raising=False)


def _rank(store: str, rank: int, ready: Event) -> None:
    """Join a two-rank gloo group; rank 1 then blocks in an all-reduce that rank 0 never joins."""
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    ready.set()
    if rank == 0:
        time.sleep(60)
    else:
        dist.all_reduce(torch.zeros(1))


def _worker(store: str, ready: Event) -> None:
    """As vLLM's worker_main: a SIGTERM handler that raises SystemExit, then the busy loop."""
    def vllm_handler(_signum: int, _frame: Any) -> None:
        raise SystemExit()

    signal.signal(signal.SIGTERM, vllm_handler)
    WorkerProc.worker_busy_loop(None)  # type: ignore[arg-type]


def exit_after_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, plugin: bool) -> int | None:
    """The blocked worker's exit code after a SIGTERM and SIGTERM_GRACE_S, or None if it was still running."""
    store = str(tmp_path / "gloo-store")
    peer_ready, worker_ready = FORK.Event(), FORK.Event()
    monkeypatch.setattr(WorkerProc, "worker_busy_loop",
                        lambda _self: _rank(store, 1, worker_ready))  # the collective stands for vLLM's step
    if plugin:
        monkeypatch.setenv(glm53_sim_worker_exit.VARIABLE, "exit")
        glm53_sim_worker_exit.register()
    peer = FORK.Process(target=_rank, args=(store, 0, peer_ready), daemon=True)
    worker = FORK.Process(target=_worker, args=(store, worker_ready), daemon=True)
    peer.start()
    worker.start()
    try:
        assert peer_ready.wait(60) and worker_ready.wait(60), "the gloo group did not form"
        # Into the all-reduce: microseconds after the event, but a loaded machine (the check tier keeps both cores busy)
        # may not run the worker for a while, and a SIGTERM that lands before it would reach vLLM's handler.
        time.sleep(2)
        os.kill(worker.pid, signal.SIGTERM)  # type: ignore[arg-type]
        worker.join(SIGTERM_GRACE_S)
        return worker.exitcode
    finally:
        for process in (worker, peer):
            process.kill()
            process.join(10)


def test_a_worker_blocked_in_a_collective_ignores_vllms_sigterm_handler(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Why the plugin exists: if this starts passing, vLLM's handler reaches blocked workers and it may be unneeded.
    assert exit_after_sigterm(tmp_path, monkeypatch, plugin=False) is None


def test_with_the_plugin_sigterm_ends_a_blocked_worker_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert exit_after_sigterm(tmp_path, monkeypatch, plugin=True) == -signal.SIGTERM


def test_registering_twice_wraps_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(glm53_sim_worker_exit.VARIABLE, "exit")
    glm53_sim_worker_exit.register()
    first = WorkerProc.worker_busy_loop
    glm53_sim_worker_exit.register()
    assert WorkerProc.worker_busy_loop is first


def test_without_the_variable_nothing_changes() -> None:
    vllms = WorkerProc.worker_busy_loop
    glm53_sim_worker_exit.register()
    assert WorkerProc.worker_busy_loop is vllms


@pytest.mark.parametrize("value", ["", "1", "EXIT", "kill"])
def test_any_other_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(glm53_sim_worker_exit.VARIABLE, value)
    with pytest.raises(ValueError, match="GLM53_SIM_WORKER_SIGTERM must be 'exit' or unset"):
        glm53_sim_worker_exit.register()
