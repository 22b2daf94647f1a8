# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""The self-healing supervisor's entry point on the head: ``python3 supervisor.py CONFIG.json`` with the
copied module_utils on PYTHONPATH (roles/self_heal/tasks/install.yml). The logic is
plugins/module_utils/self_heal.py; this file only wires it to the real clock, commands, HTTP and stdout."""
from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any, Sequence

from ansible_collections.sparkops.glm53.plugins.module_utils.health import HealthIO, subprocess_runner
from ansible_collections.sparkops.glm53.plugins.module_utils.self_heal import (
    Supervisor,
    SupervisorConfig,
    fabric_plan,
    http_client,
    memory_plan,
)


def log(line: str) -> None:
    # One line per decision change or recovery step: `docker logs glm53-self-heal` is the supervisor's log.
    print("%s %s" % (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), line), flush=True)


def stop(_signum: int, _frame: Any) -> None:
    # docker stop: leave at once; a recovery in progress releases the run lock on the way out.
    raise SystemExit(0)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 supervisor.py CONFIG.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as handle:
        config = SupervisorConfig.from_dict(json.load(handle))
    signal.signal(signal.SIGTERM, stop)
    log("watching %d rank(s), API %s, state %s" % (len(config.ranks), config.url, config.state_path))
    log(memory_plan(config.memory))
    log(fabric_plan(config.fabric))
    Supervisor(config, HealthIO(run=subprocess_runner, http=http_client), log).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
