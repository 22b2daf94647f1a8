# SPDX-License-Identifier: MIT
"""Let a simulated rank's stop end its worker at the first SIGTERM instead of four seconds later.

A stopping rank's executor (vllm/v1/executor/multiproc_executor.py `_ensure_worker_termination`) waits
VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS for its workers, sends SIGTERM, waits a fixed 4 s and sends SIGKILL. The worker's
SIGTERM handler is Python code that raises SystemExit, and Python runs it only when the main thread is back in the
interpreter: a worker blocked in a gloo collective whose peer rank is already gone never gets there, so every stop of
the simulated worker rank waited out the 4 s (7.2-7.5 s per `docker stop`, against 0.6-0.7 s for the head rank) and
ended by SIGKILL anyway. With GLM53_SIM_WORKER_SIGTERM=exit, a worker entering its busy loop puts SIGTERM back to
the kernel's default action, so the executor's SIGTERM ends it at once; a worker that exits by itself within the
grace is unaffected. The simulated cluster stops its ranks dozens of times per test run. Without the variable this
plugin changes nothing; the production image never has it (docker/sim/vllm-cpu.Dockerfile installs it into the
CPU base only).
"""

from __future__ import annotations

import os
import signal
from typing import Any

VARIABLE = "GLM53_SIM_WORKER_SIGTERM"


def wanted() -> bool:
    """True when the variable asks for it; any value but "exit" is an error, so that a typo does not pass silently."""
    value = os.environ.get(VARIABLE)
    if value is None:
        return False
    if value != "exit":
        raise ValueError("%s must be 'exit' or unset, got %r" % (VARIABLE, value))
    return True


def register() -> None:
    """vLLM general plugin: wrap WorkerProc.worker_busy_loop once per process (forked workers inherit the wrap)."""
    if not wanted():
        return
    from vllm.v1.executor.multiproc_executor import WorkerProc

    busy_loop = WorkerProc.worker_busy_loop
    if getattr(busy_loop, "glm53_sigterm_exits", False):
        return

    def worker_busy_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        # worker_main installed its SystemExit handler before this; from here on SIGTERM ends the process.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return busy_loop(self, *args, **kwargs)

    setattr(worker_busy_loop, "glm53_sigterm_exits", True)
    WorkerProc.worker_busy_loop = worker_busy_loop  # type: ignore[method-assign]
