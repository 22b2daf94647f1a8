"""tools/cpu_by_process.py: CPU per kind of process from dump-acct's lines, whole run and per window."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools import cpu_by_process

# dump-acct's format: command|version|user|system|elapsed (clock ticks)|uid|gid|mem|io|pid|ppid|flags|exit|tty|start
DUMP = """\
vllm            |v3|   700.00|   150.00|  2000.00|     0|     0| 1.0| 0|  10|   1|     |  0|__|Mon Dec  7 05:10:00 2026
pt_gloo_runloop |v3|  1000.00|   500.00|  6000.00|     0|     0| 1.0| 0|  11|   1|     |  0|__|Mon Dec  7 05:10:05 2026
python3         |v3|    20.00|     1.00|    30.00|  1000|  1000| 1.0| 0|  12|   1|     |  0|__|Mon Dec  7 05:30:00 2026
python3         |v3|    10.00|     0.00|    20.00|     0|     0| 1.0| 0|  13|   1|     |  0|__|Mon Dec  7 05:30:00 2026
ansible-playboo |v3|     5.00|     1.00|    10.00|     0|     0| 1.0| 0|  14|   1|     |  0|__|Mon Dec  7 05:30:01 2026
mystery         |v3|     3.00|     0.00|    10.00|     0|     0| 1.0| 0|  15|   1|     |  0|__|Mon Dec  7 05:30:01 2026
not a record
"""


def test_every_record_counts_once_under_its_kind() -> None:
    sums = cpu_by_process.totals(cpu_by_process.parse(DUMP.splitlines()))
    assert sums == pytest.approx({
        "vLLM engine processes (ranks and the engine tier)": 8.5 + 15.0,
        "nodes: Ansible modules as the SSH user": 0.21,
        "python3 as root (become modules)": 0.1,
        "controller: ansible-playbook and its forked workers, molecule": 0.06,
        "other": 0.03,
    })


def test_a_window_counts_the_processes_that_ended_in_it() -> None:
    # The gloo loop started at 05:10:05 and ran 60 s, so it ended at 05:11:05, inside [05:11:00, 05:12:00); the
    # vllm process ended at 05:10:20, before it; the rest ended after it.
    processes = list(cpu_by_process.parse(DUMP.splitlines()))
    sums = cpu_by_process.totals(processes, *cpu_by_process.window("w,05:11:00,05:12:00")[1:])
    assert sums == {"vLLM engine processes (ranks and the engine tier)": 15.0}


def test_main_prints_the_whole_run_and_each_window(tmp_path: Path, capsys) -> None:
    dump = tmp_path / "pacct.txt"
    dump.write_text(DUMP)
    assert cpu_by_process.main([str(dump), "late,05:20:00,06:00:00"]) == 0
    out = capsys.readouterr().out
    assert "the whole run: 0.4 CPU-min" in out
    assert "late: 0.0 CPU-min" in out and "nodes: Ansible modules as the SSH user" in out.split("late:")[1]
