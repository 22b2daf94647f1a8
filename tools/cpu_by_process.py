"""Where a run's CPU went, by kind of process, from BSD process accounting (docs/testing.md, "Round 27").

    accton /tmp/pacct          # as root, before the run (Debian's `acct` package)
    ...                        # the run, e.g. CI=true bash .ci/run in a fresh clone
    accton off
    dump-acct /tmp/pacct > /tmp/pacct.txt
    python -m tools.cpu_by_process /tmp/pacct.txt [NAME,HH:MM:SS,HH:MM:SS ...]

The kernel writes one record per process when it exits, the node containers' and their rank containers' too
(accounting reaches every PID namespace's ancestors), with the process's own user and system time. Each
NAME,START,END window counts the processes that ended in it (the tiers' times in a `make test` log).
"""
from __future__ import annotations

import argparse
import datetime
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

# vLLM's engine processes end under the name of their last thread (gloo's and ZeroMQ's loops among them).
VLLM = ("vllm", "VLLM::", "pt_", "gloo", "ZMQbg", "torch")
DOCKER = ("dockerd", "containerd", "runc", "docker", "exe", "docker-init", "docker-proxy")
PACKAGES = ("pip", "dpkg", "apt", "debootstrap", "gzip", "xz", "tar")
# The simulated nodes' SSH user (docker/sim/node.Dockerfile): its python3 processes are Ansible's modules.
NODE_USER = "1000"


@dataclass(frozen=True)
class Process:
    command: str
    uid: str
    cpu_s: float
    ended: datetime.datetime


def category(command: str, uid: str) -> str:
    if command.startswith(VLLM):
        return "vLLM engine processes (ranks and the engine tier)"
    if command.startswith(("ansible", "molecule")):
        return "controller: ansible-playbook and its forked workers, molecule"
    if command == "python3":
        return "nodes: Ansible modules as the SSH user" if uid == NODE_USER else "python3 as root (become modules)"
    if command == "python":
        return "controller virtualenv python (pytest, tools, the engine tier's first process)"
    if command in ("ssh", "sshd", "sshd-session"):
        return "ssh and sshd"
    if command.startswith(DOCKER):
        return "docker (daemons, clients, runc; host and nodes)"
    if command == "zstd":
        return "zstd (image ship)"
    if command.startswith(PACKAGES):
        return "packages and archives"
    return "other"


def parse(lines: Iterable[str]) -> Iterator[Process]:
    """dump-acct's lines: command|version|user|system|elapsed|uid|gid|mem|io|pid|ppid|flags|exit|tty|start."""
    for line in lines:
        fields = [field.strip() for field in line.split("|")]
        if len(fields) < 15:
            continue
        try:
            started = datetime.datetime.strptime(fields[14], "%a %b %d %H:%M:%S %Y")
            user, system, elapsed = (float(fields[i]) / 100 for i in (2, 3, 4))  # clock ticks (AHZ 100)
        except ValueError:
            continue
        yield Process(fields[0], fields[5], user + system, started + datetime.timedelta(seconds=elapsed))


def totals(processes: Iterable[Process], start: Optional[datetime.time] = None,
           end: Optional[datetime.time] = None) -> dict[str, float]:
    """CPU seconds per category of the processes that ended in [start, end) (all when no window)."""
    sums: dict[str, float] = defaultdict(float)
    for process in processes:
        if start is not None and end is not None and not start <= process.ended.time() < end:
            continue
        sums[category(process.command, process.uid)] += process.cpu_s
    return dict(sums)


def report(name: str, sums: dict[str, float]) -> str:
    whole = sum(sums.values())
    lines = ["%s: %.1f CPU-min of processes that ended" % (name, whole / 60)]
    for kind, seconds in sorted(sums.items(), key=lambda item: -item[1]):
        # A window of short processes can sum to 0 ticks.
        lines.append("  %-80s %6.1f CPU-min %3.0f %%" % (kind, seconds / 60, 100 * seconds / whole if whole else 0))
    return "\n".join(lines)


def window(text: str) -> tuple[str, datetime.time, datetime.time]:
    name, start, end = text.split(",")
    return name, datetime.time.fromisoformat(start), datetime.time.fromisoformat(end)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", help="dump-acct's output")
    parser.add_argument("windows", nargs="*", type=window, help="NAME,HH:MM:SS,HH:MM:SS")
    args = parser.parse_args(argv)
    with open(args.dump, encoding="utf-8", errors="replace") as handle:
        processes = list(parse(handle))
    print(report("the whole run", totals(processes)))
    for name, start, end in args.windows:
        print(report(name, totals(processes, start, end)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
