# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Ship a docker image from the head to the workers: `docker image save` | zstd, once, then the compressed
stream to every worker at the same time: ssh 'zstd -dc | docker image load' each.

The old ship was one shell pipe per worker with no timeout: a link that stalled hung the run while it held the run
lock, and N workers cost N exports and N compressions on the head. Here the module itself sits between the
stages and copies every byte (save -> zstd, zstd -> each ssh), so it knows how much moved, raw and to each worker,
and when nothing moved for `stall_timeout_s` once the first byte came out of `docker image save`:
- a worker whose ssh has not taken a byte for that long is killed alone (its process group, so a shell stand-in's
  children go too), and the others go on;
- nothing moving anywhere (the export or the compression stalled) kills every stage.
Workers that did not get the whole image start again from the first byte with a new export, up to `attempts`
times, all within `timeout_s`. The stream moves at the pace of the slowest worker still taking bytes, as `tee`.

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
from typing import IO, Callable, Dict, List, Optional, Sequence, Tuple

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


def source_stages(image: str, compression_level: int) -> List[Stage]:
    """The head's half, run once for every worker: the export and its compression (-T0: every core)."""
    return [
        Stage("docker image save", ["docker", "image", "save", image]),
        Stage("zstd", ["zstd", "-%d" % compression_level, "-T0", "-q", "-c"]),
    ]


def sink_stage(destination: str, stall_timeout_s: float, connect_timeout_s: int = 10) -> Stage:
    """One worker's half: ssh to `destination` (user@host), which decompresses and loads."""
    remote = "zstd -dc | docker image load"
    return Stage("ssh %s '%s'" % (destination, remote),
                 ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                  "-o", "ConnectTimeout=%d" % connect_timeout_s,
                  "-o", "ServerAliveInterval=%d" % keepalive(stall_timeout_s),
                  "-o", "ServerAliveCountMax=%d" % KEEPALIVE_COUNT,
                  destination, remote])


def describe_stages(sources: Sequence[Stage], sinks: Sequence[Stage]) -> str:
    """The pipeline as a shell would write it: a plain pipe for one worker, `tee` into each for several."""
    head = " | ".join(shlex.join(list(s.argv)) for s in sources)
    if len(sinks) == 1:
        return "%s | %s" % (head, shlex.join(list(sinks[0].argv)))
    return "%s | tee %s > /dev/null" % (head, " ".join(">(%s)" % shlex.join(list(s.argv)) for s in sinks))


class _Pump(threading.Thread):
    """Copies one stage's stdout into the stdin of each next stage, counting bytes and stamping progress.

    A sink that stops reading (its process exited) is dropped and the others go on; `writing` says which sink
    a write is waiting on and since when the last byte went into it, so a stalled sink can be told apart."""

    def __init__(self, source: IO[bytes], sinks: Sequence[IO[bytes]], clock: Callable[[], float],
                 on_progress: Callable[[float], None]) -> None:
        super().__init__(daemon=True)
        self.source, self.sinks, self.clock, self.on_progress = source, list(sinks), clock, on_progress
        self.read = 0
        self.counts = [0] * len(self.sinks)
        self.broken = [False] * len(self.sinks)  # that sink stopped reading (it exited or was killed)
        self.writing: Optional[Tuple[int, float]] = None

    def run(self) -> None:
        try:
            while not all(self.broken):
                try:
                    chunk = os.read(self.source.fileno(), CHUNK)
                except OSError:
                    break
                if not chunk:
                    break
                self.read += len(chunk)
                for i in range(len(self.sinks)):
                    if not self.broken[i]:
                        self._write(i, chunk)
        finally:
            for handle in (*self.sinks, self.source):
                _close(handle)

    def _write(self, i: int, chunk: bytes) -> None:
        view = memoryview(chunk)
        self.writing = (i, self.clock())
        try:
            while view:
                written = os.write(self.sinks[i].fileno(), view)
                view = view[written:]
                self.counts[i] += written
                now = self.clock()
                self.writing = (i, now)
                self.on_progress(now)
        except OSError:  # BrokenPipeError included: the sink's process is gone
            self.broken[i] = True
            _close(self.sinks[i])
        finally:
            self.writing = None


def _close(handle: IO[bytes]) -> None:
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


def run_once(sources: Sequence[Stage], sinks: Sequence[Stage], number: int, stall_timeout_s: float, deadline: float,
             clock: Callable[[], float] = time.monotonic, poll_s: float = 0.1) -> List[Attempt]:
    """One attempt for every sink: start every stage, pump between them, watch for stalls (one sink's or the
    whole stream's), the deadline or a failed source stage. One Attempt per sink, in their order."""
    started = clock()
    last = [started]
    lock = threading.Lock()

    def progress(now: float) -> None:
        with lock:
            last[0] = now

    stages = [*sources, *sinks]
    first_sink = len(sources)
    errs = [tempfile.TemporaryFile() for stage in stages]
    outs = [tempfile.TemporaryFile() for stage in sinks]
    procs: List[subprocess.Popen] = []
    try:
        for i, stage in enumerate(stages):
            procs.append(subprocess.Popen(
                list(stage.argv), stdin=subprocess.PIPE if i else subprocess.DEVNULL,
                stdout=subprocess.PIPE if i < first_sink else outs[i - first_sink], stderr=errs[i],
                start_new_session=True))
    except OSError as exc:
        _kill(procs)
        why = "%s could not start: %s" % (stages[len(procs)].name, exc)
        return [Attempt(number, "failed", clock() - started, 0, 0, why) for sink in sinks]
    pumps = [_Pump(procs[i].stdout, [procs[i + 1].stdin], clock, progress) for i in range(first_sink - 1)]
    fan = _Pump(procs[first_sink - 1].stdout, [p.stdin for p in procs[first_sink:]], clock, progress)
    pumps.append(fan)
    for pump in pumps:
        pump.start()

    outcome, why = "ok", ""
    stalled: Dict[int, float] = {}  # sink index -> seconds its write waited when it was killed
    exits: Dict[int, int] = {}  # stage index -> rc, in the order the exits were seen (the cause first)
    while True:
        for i, proc in enumerate(procs):
            if i not in exits and proc.poll() is not None:
                exits[i] = proc.returncode
        if len(exits) == len(procs):
            break
        if any(rc != 0 for i, rc in exits.items() if i < first_sink) and not all(fan.broken):
            outcome = "failed"
            break
        now = clock()
        writing = fan.writing
        if writing and now - writing[1] >= stall_timeout_s:
            # One worker stopped taking bytes: it goes, the stream goes on to the others with a fresh window.
            stalled[writing[0]] = now - writing[1]
            _kill([procs[first_sink + writing[0]]])
            progress(now)
        with lock:
            idle = now - last[0]
        # The clock starts at the producer's first byte: `docker image save` (the legacy store) exports every layer
        # before it writes one (18 s for the simulation's 3 GB image, minutes for 20+ GB), and nothing is on the link
        # until then. Before it only the time bound applies (ssh's ConnectTimeout covers a link that never opens).
        if pumps[0].read and any(p.is_alive() for p in pumps) and idle >= stall_timeout_s:
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
    seconds = round(clock() - started, 3)
    raw = pumps[0].read
    source_exits = {i: rc for i, rc in exits.items() if i < first_sink}
    # Sources that died because every sink had gone are victims, not a cause.
    source_failed = any(rc != 0 for rc in source_exits.values()) and not all(fan.broken)
    if outcome == "ok" and source_failed:
        outcome = "failed"
    source_why = _failure(sources, source_exits, killed, [p.broken[0] for p in pumps[:-1]],
                          [_tail(e) for e in errs[:first_sink]]) if source_failed else ""
    attempts = []
    for j, sink in enumerate(sinks):
        i = first_sink + j
        if j in stalled:
            attempt = Attempt(number, "stalled", seconds, raw, fan.counts[j], "no byte moved for %.1f s" % stalled[j])
        elif outcome in ("stalled", "timed out"):
            attempt = Attempt(number, outcome, seconds, raw, fan.counts[j], why)
        elif source_failed:
            attempt = Attempt(number, "failed", seconds, raw, fan.counts[j], source_why)
        elif exits[i] != 0:
            tail = _tail(errs[i])
            attempt = Attempt(number, "failed", seconds, raw, fan.counts[j],
                              "%s %s%s" % (sink.name, _exit_text(exits[i]), " (%s)" % tail if tail else ""))
        elif fan.broken[j]:
            attempt = Attempt(number, "failed", seconds, raw, fan.counts[j],
                              "%s stopped reading before the end of the stream (it exited 0)" % sink.name)
        else:
            attempt = Attempt(number, "ok", seconds, raw, fan.counts[j], _tail(outs[j]))
        attempts.append(attempt)
    for handle in (*errs, *outs):
        handle.close()
    return attempts


def _failure(stages: Sequence[Stage], exits: Dict[int, int], killed: Sequence[int], broken: Sequence[bool],
             stderr: Sequence[str]) -> str:
    """Why the source stages failed, naming the cause, not its victims: when stage k stopped reading, the stages
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


def ship(sources: Sequence[Stage], sinks: Sequence[Stage], policy: Policy,
         clock: Callable[[], float] = time.monotonic) -> List[ShipResult]:
    """Stream the sources' output to every sink; sinks that did not get it whole go again together, until each
    has succeeded, `policy.attempts` have run, or `timeout_s` has passed. One ShipResult per sink."""
    started = clock()
    deadline = started + policy.timeout_s
    results = [ShipResult() for sink in sinks]
    pending = list(range(len(sinks)))
    for number in range(1, policy.attempts + 1):
        attempts = run_once(sources, [sinks[i] for i in pending], number, policy.stall_timeout_s, deadline, clock,
                            policy.poll_s)
        for i, attempt in zip(pending, attempts):
            results[i].attempts.append(attempt)
            results[i].seconds = round(clock() - started, 3)
        pending = [i for i in pending if results[i].attempts[-1].outcome != "ok"]
        if not pending or any(a.outcome == "timed out" for a in attempts) or clock() >= deadline:
            break
    return results


def report_line(worker: str, result: ShipResult) -> str:
    """One line per worker for the run's output."""
    ratio = (" (%.1fx)" % (result.raw_bytes / result.wire_bytes)) if result.wire_bytes else ""
    tries = len(result.attempts)
    text = "image ship to %s: %s in %.1f s, %s raw, %s on the wire%s, %d attempt%s" % (
        worker, "ok" if result.ok else "FAILED", result.seconds, human_bytes(result.raw_bytes),
        human_bytes(result.wire_bytes), ratio, tries, "" if tries == 1 else "s")
    earlier = [a.describe() for a in result.attempts if a.outcome != "ok"]
    return text + ("; " + "; ".join(earlier) if earlier else "")


def failure_message(failed: Sequence[Tuple[str, ShipResult]], settings_hint: str) -> str:
    """One message for every worker that did not get the image, each with its attempts."""
    each = "; to ".join("%s: %s" % (worker, "; ".join(a.describe() for a in result.attempts))
                        for worker, result in failed)
    whose = "the worker's" if len(failed) == 1 else "each of these workers'"
    return ("Could not ship the engine image to %s. docker image load tags nothing until the whole archive has "
            "arrived, so %s old image is untouched. %s" % (each, whose, settings_hint)).strip()
