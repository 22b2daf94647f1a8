# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Ship a docker image from the head to one worker: `docker image save` | zstd | ssh 'zstd -dc | docker image load'.

The old ship was one shell pipe with no timeout: a link that stalled hung the run while it held the run lock.
Here the module itself sits between the stages and copies every byte (save -> zstd, zstd -> ssh), so it knows
how much moved, raw and on the wire, and when nothing moved for `stall_timeout_s` once the first byte came out of
`docker image save`: then it kills every stage
(each runs in its own process group, so a shell stand-in's children go too) and starts again from the first
byte, up to `attempts` times, all within `timeout_s`.

Why restart rather than resume: `docker image load` tags nothing until it has read the whole archive (the
legacy store untars the stream into a temporary directory first, the containerd store imports every blob
before it creates the image), so an interrupted load leaves the worker's old image as it was, and a clean
restart is always safe. A resume would need a file on the worker's disk as large as the image.

After the last byte has gone into ssh, the worker may still take a while to register the layers; no byte
moves then, so the stall timer stops and ssh's own keep-alive (tied to the stall timeout by `keepalive`) ends
a session whose peer has gone, and `timeout_s` bounds the rest.

The stages are argv lists passed in, so tests run the real pump with stand-in commands.
"""
from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, List, Sequence

CHUNK = 1 << 20
# ssh gives up on a silent peer after ServerAliveInterval x ServerAliveCountMax seconds.
KEEPALIVE_COUNT = 3
STDERR_TAIL = 400


@dataclass(frozen=True)
class Stage:
    """One process of the pipeline; `name` is how messages refer to it."""

    name: str
    argv: Sequence[str]


@dataclass(frozen=True)
class Policy:
    stall_timeout_s: float
    attempts: int
    timeout_s: float
    poll_s: float = 0.1

    def errors(self) -> List[str]:
        problems = []
        if self.stall_timeout_s <= 0:
            problems.append("stall_timeout must be > 0 (got %r)" % self.stall_timeout_s)
        if self.attempts < 1:
            problems.append("attempts must be >= 1 (got %r)" % self.attempts)
        if self.timeout_s <= 0:
            problems.append("timeout must be > 0 (got %r)" % self.timeout_s)
        return problems


@dataclass
class Attempt:
    number: int
    outcome: str  # ok | stalled | timed out | failed
    seconds: float
    raw_bytes: int
    wire_bytes: int
    detail: str = ""

    def describe(self) -> str:
        text = "attempt %d %s after %.1f s (%s raw, %s on the wire)" % (
            self.number, self.outcome, self.seconds, human_bytes(self.raw_bytes), human_bytes(self.wire_bytes))
        return text + (": " + self.detail if self.detail else "")


@dataclass
class ShipResult:
    attempts: List[Attempt] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].outcome == "ok"

    @property
    def raw_bytes(self) -> int:
        return self.attempts[-1].raw_bytes if self.attempts else 0

    @property
    def wire_bytes(self) -> int:
        return self.attempts[-1].wire_bytes if self.attempts else 0

    @property
    def wire_bytes_total(self) -> int:
        return sum(a.wire_bytes for a in self.attempts)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024
    return "%.1f GiB" % n  # pragma: no cover - the loop always returns


def keepalive(stall_timeout_s: float) -> int:
    """ServerAliveInterval so that ssh drops a silent peer within about the stall timeout (at least 1 s)."""
    return max(1, int(math.ceil(stall_timeout_s / KEEPALIVE_COUNT)))


def ship_stages(image: str, destination: str, compression_level: int, stall_timeout_s: float,
                connect_timeout_s: int = 10) -> List[Stage]:
    """The three processes of a ship to `destination` (user@host), zstd on both ends (-T0: every core)."""
    remote = "zstd -dc | docker image load"
    return [
        Stage("docker image save", ["docker", "image", "save", image]),
        Stage("zstd", ["zstd", "-%d" % compression_level, "-T0", "-q", "-c"]),
        Stage("ssh %s '%s'" % (destination, remote),
              ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
               "-o", "ConnectTimeout=%d" % connect_timeout_s,
               "-o", "ServerAliveInterval=%d" % keepalive(stall_timeout_s),
               "-o", "ServerAliveCountMax=%d" % KEEPALIVE_COUNT,
               destination, remote]),
    ]


def describe_stages(stages: Sequence[Stage]) -> str:
    return " | ".join(shlex.join(list(s.argv)) for s in stages)


class _Pump(threading.Thread):
    """Copies one stage's stdout into the next one's stdin, counting bytes and stamping progress."""

    def __init__(self, source: IO[bytes], sink: IO[bytes], clock: Callable[[], float],
                 on_progress: Callable[[float], None]) -> None:
        super().__init__(daemon=True)
        self.source, self.sink, self.clock, self.on_progress = source, sink, clock, on_progress
        self.count = 0
        self.broken = False  # the next stage stopped reading (it exited)

    def run(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self.source.fileno(), CHUNK)
                except OSError:
                    break
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    written = os.write(self.sink.fileno(), view)
                    view = view[written:]
                    self.count += written
                    self.on_progress(self.clock())
        except (BrokenPipeError, OSError):
            self.broken = True
        finally:
            for handle in (self.sink, self.source):
                try:
                    handle.close()
                except OSError:
                    pass


def _tail(handle: IO[bytes]) -> str:
    handle.seek(0)
    text = handle.read().decode(errors="replace").strip()
    return " ".join(text[-STDERR_TAIL:].split())


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return "was killed by %s" % signal.Signals(-rc).name
        except ValueError:
            return "was killed by signal %d" % -rc
    return "exited %d" % rc


def run_once(stages: Sequence[Stage], number: int, stall_timeout_s: float, deadline: float,
             clock: Callable[[], float] = time.monotonic, poll_s: float = 0.1) -> Attempt:
    """One attempt: start every stage, pump between them, watch for a stall, a deadline or a failed stage."""
    started = clock()
    last = [started]
    lock = threading.Lock()

    def progress(now: float) -> None:
        with lock:
            last[0] = now

    errs = [tempfile.TemporaryFile() for stage in stages]
    out = tempfile.TemporaryFile()
    procs: List[subprocess.Popen] = []
    pumps: List[_Pump] = []
    try:
        for i, stage in enumerate(stages):
            procs.append(subprocess.Popen(
                list(stage.argv), stdin=subprocess.PIPE if i else subprocess.DEVNULL,
                stdout=subprocess.PIPE if i < len(stages) - 1 else out, stderr=errs[i], start_new_session=True))
    except OSError as exc:
        _kill(procs)
        return Attempt(number, "failed", clock() - started, 0, 0,
                       "%s could not start: %s" % (stages[len(procs)].name, exc))
    for i in range(len(stages) - 1):
        pumps.append(_Pump(procs[i].stdout, procs[i + 1].stdin, clock, progress))
        pumps[-1].start()

    outcome, why = "ok", ""
    exits: dict[int, int] = {}  # stage index -> rc, in the order the exits were seen (the cause first)
    while True:
        for i, proc in enumerate(procs):
            if i not in exits and proc.poll() is not None:
                exits[i] = proc.returncode
        if len(exits) == len(procs):
            break
        if any(rc != 0 for rc in exits.values()):
            outcome = "failed"
            break
        now = clock()
        with lock:
            idle = now - last[0]
        # The clock starts at the producer's first byte: `docker image save` (the legacy store) exports every layer
        # before it writes one (18 s for the simulation's 3 GB image, minutes for 20+ GB), and nothing is on the link
        # until then. Before it only the time bound applies (ssh's ConnectTimeout covers a link that never opens).
        if pumps and pumps[0].count and any(p.is_alive() for p in pumps) and idle >= stall_timeout_s:
            outcome, why = "stalled", "no byte moved for %.1f s" % idle
            break
        if now >= deadline:
            outcome, why = "timed out", "the ship's time bound ran out"
            break
        time.sleep(poll_s)

    killed = _kill(procs)
    for pump in pumps:
        pump.join(timeout=5)
    for i, proc in enumerate(procs):
        exits.setdefault(i, proc.returncode)
    seconds = clock() - started
    raw = pumps[0].count if pumps else 0
    wire = pumps[-1].count if pumps else 0
    if outcome == "ok" and (any(rc != 0 for rc in exits.values()) or any(p.broken for p in pumps)):
        outcome = "failed"
    if outcome == "failed":
        why = _failure(stages, exits, killed, [p.broken for p in pumps], [_tail(e) for e in errs])
    elif outcome == "ok":
        why = _tail(out)
    for handle in (*errs, out):
        handle.close()
    return Attempt(number, outcome, round(seconds, 3), raw, wire, why)


def _failure(stages: Sequence[Stage], exits: dict[int, int], killed: Sequence[int], broken: Sequence[bool],
             stderr: Sequence[str]) -> str:
    """Why an attempt failed, naming the cause, not its victims: when stage k stopped reading, the stages
    before it die of the broken pipe (SIGPIPE, "Broken pipe"), which says nothing about the cause."""
    first = max((i + 1 for i, b in enumerate(broken) if b), default=0)
    causes = ["%s %s%s" % (stages[i].name, _exit_text(rc), " (%s)" % stderr[i] if stderr[i] else "")
              for i, rc in exits.items() if rc != 0 and i not in killed and i >= first]
    if first and exits.get(first) == 0:
        causes.append("%s stopped reading before the end of the stream (it exited 0)" % stages[first].name)
    return "; ".join(causes) or "; ".join(
        "%s %s" % (stages[i].name, _exit_text(rc)) for i, rc in exits.items() if rc != 0)


def _kill(procs: Sequence[subprocess.Popen]) -> List[int]:
    """Kill every stage still running, with its whole process group; the indexes of those killed."""
    killed = []
    for i, proc in enumerate(procs):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            killed.append(i)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait for anyone
            pass
    return killed


def ship(stages: Sequence[Stage], policy: Policy, clock: Callable[[], float] = time.monotonic) -> ShipResult:
    """Run the pipeline until one attempt succeeds, `policy.attempts` have failed, or `timeout_s` has passed."""
    started = clock()
    deadline = started + policy.timeout_s
    result = ShipResult()
    for number in range(1, policy.attempts + 1):
        attempt = run_once(stages, number, policy.stall_timeout_s, deadline, clock, policy.poll_s)
        result.attempts.append(attempt)
        if attempt.outcome in ("ok", "timed out") or clock() >= deadline:
            break
    result.seconds = round(clock() - started, 3)
    return result


def report_line(worker: str, result: ShipResult) -> str:
    """One line per worker for the run's output."""
    ratio = (" (%.1fx)" % (result.raw_bytes / result.wire_bytes)) if result.wire_bytes else ""
    tries = len(result.attempts)
    text = "image ship to %s: %s in %.1f s, %s raw, %s on the wire%s, %d attempt%s" % (
        worker, "ok" if result.ok else "FAILED", result.seconds, human_bytes(result.raw_bytes),
        human_bytes(result.wire_bytes), ratio, tries, "" if tries == 1 else "s")
    earlier = [a.describe() for a in result.attempts if a.outcome != "ok"]
    return text + ("; " + "; ".join(earlier) if earlier else "")


def failure_message(worker: str, result: ShipResult, settings_hint: str) -> str:
    return ("Could not ship the engine image to %s: %s. docker image load tags nothing until the whole archive "
            "has arrived, so the worker's old image is untouched. %s" % (
                worker, "; ".join(a.describe() for a in result.attempts), settings_hint))
