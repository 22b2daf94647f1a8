# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Readiness logic for a multi-node vLLM launch, shared by the ``vllm_health`` module.

The decisions (is a rank dead, is the API up, is the canary answer coherent) are pure functions and
small classes. The waiting loop takes its I/O (commands, HTTP, clock, sleep, progress sink) as
arguments, so tests drive it without docker, SSH or a network. The adapters at the bottom (subprocess and
Ansible's open_url) are what the module plugs in on the target node.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone
import re
import shlex
import subprocess
import tempfile
import time
import urllib.error
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

INSPECT_FORMAT = "{{.State.Status}} {{.State.ExitCode}} {{.State.FinishedAt}}"
SSH_OPTIONS: Tuple[str, ...] = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
# States after which the container will not come back by itself: fail at once.
TERMINAL_STATES = frozenset({"exited", "dead"})
CANARY_BODY_LIMIT = 4000
# The answer quoted in a failed canary message (the whole body is returned separately as evidence).
CANARY_TEXT_LIMIT = 300

PHASE_HEALTH = "waiting_health"
PHASE_MODELS = "waiting_models"
PHASE_WARMUP = "warmup"
PHASE_CANARY = "canary"
PHASE_READY = "ready"
PHASE_FAILED = "failed"


# --------------------------------------------------------------------------- ranks / containers


@dataclass(frozen=True)
class Rank:
    rank: int
    node: str
    container: str
    ssh: Optional[str] = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Rank":
        ssh = data.get("ssh") or None
        return cls(rank=int(data["rank"]), node=str(data["node"]), container=str(data["container"]), ssh=ssh)

    def label(self) -> str:
        return "rank %d on node %s (container %s)" % (self.rank, self.node, self.container)


@dataclass(frozen=True)
class ContainerState:
    """What ``docker inspect`` said about one container. ``status`` is docker's word, or one of
    ``missing`` (no such container), ``unreachable`` (ssh failed), ``unknown`` (anything else)."""

    status: str
    exit_code: Optional[int] = None
    detail: str = ""
    # docker's RFC 3339 time of the last exit (None while it never exited): orders deaths across ranks.
    finished_at: Optional[str] = None

    @property
    def running(self) -> bool:
        return self.status == "running"

    def describe(self) -> str:
        text = self.status
        if self.exit_code is not None and not self.running:
            text += " (exit code %d)" % self.exit_code
        if self.detail:
            text += ": " + self.detail
        return text


def remote_argv(argv: Sequence[str], ssh: Optional[str], shell_suffix: str = "") -> List[str]:
    """Run ``argv`` locally, or on ``ssh`` (user@host) through a non-interactive ssh."""
    if not ssh:
        return list(argv)
    command = shlex.join(list(argv))
    if shell_suffix:
        command += " " + shell_suffix
    return ["ssh", *SSH_OPTIONS, ssh, command]


def docker_inspect_argv(rank: Rank) -> List[str]:
    return remote_argv(["docker", "inspect", "-f", INSPECT_FORMAT, rank.container], rank.ssh)


def docker_logs_argv(rank: Rank, tail: int) -> List[str]:
    # Over ssh, merge the container's stderr remotely so its lines keep their order.
    return remote_argv(["docker", "logs", "--tail", str(int(tail)), rank.container], rank.ssh, "2>&1")


def parse_inspect(rc: int, stdout: str, stderr: str, via_ssh: bool = False) -> ContainerState:
    """Turn the result of ``docker inspect -f INSPECT_FORMAT`` into a ContainerState."""
    err = " ".join(stderr.split())
    if rc == 0:
        parts = stdout.strip().split()
        if not parts:
            return ContainerState("unknown", detail="empty docker inspect output")
        exit_code: Optional[int] = None
        if len(parts) > 1:
            try:
                exit_code = int(parts[1])
            except ValueError:
                exit_code = None
        finished = parts[2] if len(parts) > 2 and docker_time(parts[2]) is not None else None
        return ContainerState(parts[0].lower(), exit_code, finished_at=finished)
    lowered = err.lower()
    if "no such object" in lowered or "no such container" in lowered:
        return ContainerState("missing", detail=err[:300])
    if via_ssh and rc == 255:
        return ContainerState("unreachable", detail=err[:300] or "ssh exited 255")
    return ContainerState("unknown", detail=(err[:300] or "docker inspect exited %d" % rc))


def docker_time(text: str) -> Optional[float]:
    """Seconds since the epoch of a docker RFC 3339 time (nanoseconds, trailing zeros trimmed), or None
    for docker's zero time (never exited) and anything unparsable."""
    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", text.strip())
    if not match or match.group(1).startswith("0001-"):
        return None
    zone = "+00:00" if match.group(3) == "Z" else match.group(3)
    try:
        base = datetime.fromisoformat(match.group(1) + zone)
    except ValueError:
        return None
    fraction = float("0." + match.group(2)) if match.group(2) else 0.0
    return base.astimezone(timezone.utc).timestamp() + fraction


def death_order(rank: Rank, state: ContainerState) -> Tuple[int, float, int]:
    """Sort key for ranks found dead in the same poll: the one whose container exited first caused the
    others to follow (a head whose worker vanished exits too); ranks without an exit time come last."""
    when = docker_time(state.finished_at) if state.finished_at else None
    return (0, when, rank.rank) if when is not None else (1, 0.0, rank.rank)


@dataclass(frozen=True)
class RankVerdict:
    failed: bool
    reason: str = ""


class RankWatch:
    """Counts consecutive polls on which each rank's container was not running.

    An exited or dead container fails at once; any other not-running state (created, restarting,
    missing, ssh unreachable) fails after ``threshold`` polls in a row, so a slow ``docker run`` or one
    ssh hiccup does not abort a one-hour wait, while a dead worker is noticed in seconds instead of at
    the ready timeout.
    """

    def __init__(self, threshold: int = 3) -> None:
        if threshold < 1:
            raise ValueError("threshold must be >= 1")
        self.threshold = threshold
        self.misses: Dict[int, int] = {}

    def observe(self, rank: Rank, state: ContainerState) -> RankVerdict:
        if state.running:
            self.misses[rank.rank] = 0
            return RankVerdict(False)
        if state.status in TERMINAL_STATES:
            return RankVerdict(True, "container %s" % state.describe())
        count = self.misses.get(rank.rank, 0) + 1
        self.misses[rank.rank] = count
        if count >= self.threshold:
            return RankVerdict(True, "container not running for %d consecutive polls: %s" % (count, state.describe()))
        return RankVerdict(False)


def split_log_lines(text: str) -> List[str]:
    return [line for line in text.splitlines() if line.strip()]


def last_log_line(text: str) -> str:
    lines = split_log_lines(text)
    return lines[-1].strip()[:500] if lines else ""


# --------------------------------------------------------------------------- API checks


def openai_api_options() -> Dict[str, Dict[str, Any]]:
    """The argument spec of the options in doc fragment sparkops.glm53.openai_api."""
    return {
        "url": {"type": "str", "default": "http://127.0.0.1:8888"},
        "served_model_name": {"type": "str", "required": True},
        "api_key": {"type": "str", "no_log": True},
    }


def api_headers(api_key: Optional[str]) -> Dict[str, str]:
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    return headers


def models_from_body(body: str) -> Optional[List[str]]:
    """Model ids from an OpenAI ``/v1/models`` body, or None when it is not that shape."""
    try:
        data = json.loads(body)
    except (TypeError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        return None
    return [str(item["id"]) for item in data["data"] if isinstance(item, dict) and "id" in item]


@dataclass(frozen=True)
class ModelsCheck:
    ready: bool
    fatal: bool
    models: List[str]
    reason: str = ""


def check_models(status: int, body: str, served_model_name: str) -> ModelsCheck:
    """Decide on a ``GET /v1/models`` answer. vLLM's model list is fixed once it answers, so a list
    without our name (or a rejected key) is a configuration error that waiting will not fix."""
    if status in (401, 403):
        return ModelsCheck(False, True, [], "/v1/models answered %d: api_key rejected" % status)
    if status != 200:
        return ModelsCheck(False, False, [], "/v1/models answered %d" % status)
    models = models_from_body(body)
    if models is None:
        return ModelsCheck(False, False, [], "/v1/models body is not an OpenAI model list")
    if served_model_name not in models:
        return ModelsCheck(False, True, models, "served model %r is not in /v1/models %r" % (served_model_name, models))
    return ModelsCheck(True, False, models)


# --------------------------------------------------------------------------- canary


@dataclass(frozen=True)
class Canary:
    prompt: str = "Reply with one short sentence: what is the capital of France?"
    max_tokens: int = 32
    expect_regex: Optional[str] = None
    enable_thinking: bool = False

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "Canary":
        data = data or {}
        default = cls()
        return cls(
            prompt=str(data.get("prompt") or default.prompt),
            max_tokens=int(data.get("max_tokens") or default.max_tokens),
            expect_regex=data.get("expect_regex") or None,
            enable_thinking=bool(data.get("enable_thinking", False)),
        )


def canary_request(canary: Canary, served_model_name: str) -> Dict[str, Any]:
    # chat_template_kwargs must sit at the top level of the body: vLLM ignores it inside extra_body.
    return {
        "model": served_model_name,
        "messages": [{"role": "user", "content": canary.prompt}],
        "max_tokens": canary.max_tokens,
        "temperature": 0,
        "stream": False,
        "chat_template_kwargs": {"enable_thinking": canary.enable_thinking},
    }


def pattern_error(pattern: Optional[str]) -> Optional[str]:
    """Why `pattern` is not a usable regular expression, or None (also for no pattern)."""
    if not pattern:
        return None
    try:
        re.compile(pattern)
    except re.error as exc:
        return "%s in %r" % (exc, pattern)
    return None


def is_degenerate(text: str) -> bool:
    """A broken engine (NaN logits, bad weights) often emits one token over and over ("!!!!!!!!")
    while /health is green. Flag a long answer made of a single repeated character."""
    compact = "".join(text.split())
    return len(compact) >= 8 and len(set(compact)) == 1


@dataclass(frozen=True)
class CanaryResult:
    ok: bool
    text: str = ""
    reason: str = ""
    finish_reason: Optional[str] = None
    completion_tokens: Optional[int] = None


def evaluate_canary(status: int, body: str, expect_regex: Optional[str] = None) -> CanaryResult:
    if status != 200:
        return CanaryResult(False, reason="canary request answered HTTP %d" % status)
    try:
        data = json.loads(body)
        choice = data["choices"][0]
        content = choice.get("message", {}).get("content")
    except (TypeError, ValueError, KeyError, IndexError, AttributeError):
        return CanaryResult(False, reason="canary response is not a chat completion")
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    usage = data.get("usage") if isinstance(data, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    text = content if isinstance(content, str) else ""
    if not text.strip():
        return CanaryResult(False, text, "canary answer is empty", finish, tokens)
    if is_degenerate(text):
        return CanaryResult(False, text, "canary answer is degenerate (one repeated character)", finish, tokens)
    # An engine with wrong kernels or weights can answer fluent, varied text that is not an answer at all; only
    # a prompt with a checkable answer and a pattern for it catches that.
    if expect_regex and not re.search(expect_regex, text):
        return CanaryResult(False, text, "canary answer %s does not match the pattern %s (glm53_canary_expect)"
                            % (json.dumps(text[:CANARY_TEXT_LIMIT]), expect_regex), finish, tokens)
    return CanaryResult(True, text, "", finish, tokens)


# --------------------------------------------------------------------------- the waiting loop


@dataclass(frozen=True)
class HttpResult:
    status: int  # 0 when no HTTP answer came (refused, timeout)
    body: str = ""
    error: str = ""

    def describe(self) -> str:
        return "HTTP %d" % self.status if self.status else (self.error or "no answer")


Runner = Callable[[Sequence[str], float, bool], Tuple[int, str, str]]
Http = Callable[[str, str, Mapping[str, str], Optional[bytes], float], HttpResult]


@dataclass
class HealthIO:
    run: Runner
    http: Http
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    progress: Optional[Callable[[Dict[str, Any]], None]] = None


@dataclass
class HealthConfig:
    url: str
    served_model_name: str
    ranks: List[Rank]
    api_key: Optional[str] = None
    timeout: float = 3600.0
    poll_interval: float = 5.0
    log_tail: int = 40
    canary: Canary = field(default_factory=Canary)
    warmup_requests: int = 1
    not_running_polls: int = 3
    request_timeout: float = 600.0
    command_timeout: float = 30.0
    # False: one look; an API not serving yet (and no rank dead) ends the run unfailed, with ready false.
    wait: bool = True


@dataclass
class HealthOutcome:
    failed: bool
    msg: str
    result: Dict[str, Any]


class HealthWaiter:
    """Polls rank containers and the API until vLLM serves, then warms it up and asks the canary."""

    def __init__(self, config: HealthConfig, io: HealthIO) -> None:
        self.cfg = config
        self.io = io
        self.base = config.url.rstrip("/")
        self.watch = RankWatch(config.not_running_polls)
        self.start = io.clock()
        self.polls = 0
        self.phase = PHASE_HEALTH
        self.last_line = ""
        self.last_api = ""
        self.states: Dict[int, ContainerState] = {}

    # -- small I/O helpers
    def elapsed(self) -> float:
        return round(self.io.clock() - self.start, 3)

    def inspect(self, rank: Rank) -> ContainerState:
        try:
            rc, out, err = self.io.run(docker_inspect_argv(rank), self.cfg.command_timeout, False)
        except Exception as exc:  # a hung ssh or missing docker binary is a poll miss, not a crash
            return ContainerState("unknown", detail=str(exc)[:300])
        return parse_inspect(rc, out, err, via_ssh=bool(rank.ssh))

    def logs(self, rank: Rank, tail: int) -> str:
        try:
            _rc, out, _err = self.io.run(docker_logs_argv(rank, tail), self.cfg.command_timeout, True)
        except Exception as exc:
            return "(docker logs failed: %s)" % exc
        return out

    def get(self, path: str) -> HttpResult:
        timeout = min(30.0, max(1.0, self.cfg.poll_interval * 2))
        return self.io.http("GET", self.base + path, api_headers(self.cfg.api_key), None, timeout)

    def post_chat(self) -> HttpResult:
        headers = dict(api_headers(self.cfg.api_key), **{"Content-Type": "application/json"})
        body = json.dumps(canary_request(self.cfg.canary, self.cfg.served_model_name)).encode()
        return self.io.http("POST", self.base + "/v1/chat/completions", headers, body, self.cfg.request_timeout)

    def head(self) -> Rank:
        return min(self.cfg.ranks, key=lambda r: r.rank)

    def report(self) -> None:
        if self.io.progress is None:
            return
        if self.cfg.ranks and self.phase in (PHASE_HEALTH, PHASE_MODELS):
            line = last_log_line(self.logs(self.head(), 1))
            self.last_line = line or self.last_line
        self.io.progress({"elapsed_s": self.elapsed(), "phase": self.phase, "last_log_line": self.last_line,
                          "polls": self.polls, "timeout_s": self.cfg.timeout})

    def base_result(self) -> Dict[str, Any]:
        return {
            "changed": False,
            "elapsed_s": self.elapsed(),
            "polls": self.polls,
            "phase": self.phase,
            "rank_states": {str(r): s.describe() for r, s in sorted(self.states.items())},
        }

    def fail(self, msg: str, **extra: Any) -> HealthOutcome:
        self.phase = PHASE_FAILED
        result = self.base_result()
        result.update(extra)
        self.report()
        return HealthOutcome(True, msg, result)

    # -- one poll
    def check_ranks(self) -> Optional[HealthOutcome]:
        dead: List[Tuple[Rank, ContainerState, RankVerdict]] = []
        for rank in self.cfg.ranks:
            state = self.inspect(rank)
            self.states[rank.rank] = state
            verdict = self.watch.observe(rank, state)
            if verdict.failed:
                dead.append((rank, state, verdict))
        if not dead:
            return None
        dead.sort(key=lambda item: death_order(item[0], item[1]))
        rank, state, verdict = dead[0]
        tail = split_log_lines(self.logs(rank, self.cfg.log_tail))
        self.last_line = tail[-1].strip()[:500] if tail else self.last_line
        msg = "%s failed: %s" % (rank.label(), verdict.reason)
        if len(dead) > 1:
            msg += " (first of %d; then %s)" % (len(dead), "; ".join(
                "%s: %s" % (r.label(), v.reason) for r, _s, v in dead[1:]))
        return self.fail(
            msg, failed_rank=rank.rank, failed_node=rank.node, failed_container=rank.container,
            failed_at=state.finished_at, log_tail=tail,
            failed_ranks=[{"rank": r.rank, "node": r.node, "container": r.container, "state": s.describe(),
                           "finished_at": s.finished_at} for r, s, _v in dead],
        )

    def check_api(self) -> Tuple[Optional[ModelsCheck], str]:
        health = self.get("/health")
        if health.status != 200:
            self.phase = PHASE_HEALTH
            return None, "/health: " + health.describe()
        self.phase = PHASE_MODELS
        models = self.get("/v1/models")
        check = check_models(models.status, models.body, self.cfg.served_model_name)
        return check, check.reason or "ready"

    def probe(self) -> Dict[str, Any]:
        """One non-waiting look (check mode): never fails, reports what it saw."""
        self.polls = 1
        dead = self.check_ranks()
        check, api = self.check_api()
        all_running = all(state.running for state in self.states.values())
        ready = bool(check and check.ready) and dead is None and all_running
        result = dead.result if dead else self.base_result()
        result.update({"ready": ready, "api": api, "models": check.models if check else [],
                       "ranks_running": all_running})
        if dead:
            result["rank_failure"] = dead.msg
        result["phase"] = PHASE_READY if ready else (PHASE_FAILED if dead else self.phase)
        return result

    def wait_ready(self) -> Tuple[Optional[HealthOutcome], List[str]]:
        while True:
            self.polls += 1
            dead = self.check_ranks()
            if dead:
                return dead, []
            check, self.last_api = self.check_api()
            if check and check.fatal:
                return self.fail(check.reason, models=check.models), []
            if check and check.ready:
                return None, check.models
            if not self.cfg.wait:
                result = self.base_result()
                result.update({"ready": False, "api": self.last_api})
                return HealthOutcome(False, "vLLM does not serve yet (phase %s); not waited for" % self.phase,
                                     result), []
            self.report()
            if self.io.clock() - self.start >= self.cfg.timeout:
                tail = split_log_lines(self.logs(self.head(), self.cfg.log_tail)) if self.cfg.ranks else []
                return self.fail(
                    "vLLM not ready after %ss (phase %s, last %s)" % (self.cfg.timeout, self.phase, self.last_api),
                    log_tail=tail,
                ), []
            self.io.sleep(self.cfg.poll_interval)

    def run(self) -> HealthOutcome:
        outcome, models = self.wait_ready()
        if outcome:
            return outcome
        ready_after = self.elapsed()

        self.phase = PHASE_WARMUP
        self.report()
        warm_start = self.io.clock()
        warmup_statuses = [self.post_chat().status for _request in range(max(0, self.cfg.warmup_requests))]
        warmup_s = round(self.io.clock() - warm_start, 3)

        self.phase = PHASE_CANARY
        self.report()
        answer = self.post_chat()
        verdict = evaluate_canary(answer.status, answer.body, self.cfg.canary.expect_regex)
        common = {"ready_after_s": ready_after, "models": models, "warmup_s": warmup_s,
                  "warmup_statuses": warmup_statuses, "canary_text": verdict.text}
        if not verdict.ok:
            return self.fail(
                "vLLM answers /health but the canary failed: %s"
                % (verdict.reason if answer.status else answer.describe()),
                canary_status=answer.status, canary_body=(answer.body or answer.error)[:CANARY_BODY_LIMIT],
                canary_finish_reason=verdict.finish_reason, canary_completion_tokens=verdict.completion_tokens,
                **common,
            )
        self.phase = PHASE_READY
        result = self.base_result()
        result.update(common)
        result.update({"canary_finish_reason": verdict.finish_reason,
                       "canary_completion_tokens": verdict.completion_tokens, "ready": True})
        self.report()
        return HealthOutcome(False, "vLLM ready after %ss" % ready_after, result)


# --------------------------------------------------------------------------- stdlib adapters


def subprocess_runner(argv: Sequence[str], timeout: float, merge_stderr: bool) -> Tuple[int, str, str]:
    try:
        proc = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired:
        return 124, "", "timed out after %ss: %s" % (timeout, argv[0])
    except OSError as exc:
        return 127, "", str(exc)
    out = (proc.stdout or b"").decode("utf-8", "replace")
    err = (proc.stderr or b"").decode("utf-8", "replace") if not merge_stderr else ""
    return proc.returncode, out, err


def urllib_http(method: str, url: str, headers: Mapping[str, str], body: Optional[bytes], timeout: float) -> HttpResult:
    # Imported here: the self-healing supervisor runs this file's waiting loop on the head's plain python3,
    # without Ansible, and brings its own HTTP adapter (self_heal.http_client).
    from ansible.module_utils.urls import ConnectionError as UrlsConnectionError, open_url

    try:
        with open_url(url, data=body, headers=dict(headers), method=method, timeout=timeout) as resp:
            return HttpResult(resp.status, resp.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        return HttpResult(exc.code, exc.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, UrlsConnectionError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return HttpResult(0, "", "%s: %s" % (type(exc).__name__, reason))


def progress_file_writer(path: str) -> Callable[[Dict[str, Any]], None]:
    """Write each progress record atomically, so a reader never sees half a JSON document."""
    directory = os.path.dirname(os.path.abspath(path)) or "."

    def write(record: Dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".progress-", dir=directory)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(record, handle)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    return write
