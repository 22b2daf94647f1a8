# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Self-healing: the supervisor that re-forms the rank group on the head after a reboot or a dead rank.

One decision, ``decide``, is a pure function of what was observed (every rank container's state, the
API's /health, the run lock) and of the state kept on the head's disk; it answers "do nothing", "recover"
or "give up". ``Supervisor`` is the loop around it, with its I/O (commands, HTTP, clock, sleep) injected as
in ``health.py``, so tests drive it without docker or SSH. A recovery restarts the WHOLE group in order:
every rank stopped (a TP group cannot re-form around a survivor), every worker started, then the head,
then the same wait and canary as the ``health`` stage, bounded by ``glm53_ready_timeout``. Between the stop
and the first start, every node's clean page cache is dropped and its memory judged with preflight's own
budget (``memory_budget.plan_memory``): on a GB10 a crashed rank leaves its checkpoint in page cache that
CUDA does not get back, so a restart without the drop fails. A budget that does not fit starts nothing.
Before that, with RDMA on, every rail's RoCE v2 GID slot that the ranks' NCCL_IB_GID_INDEX names is read
again: a reboot can move GID indices, and a rank restarted on a stale index fails or hangs on RoCE. A moved
index starts nothing and gives up at once (only a site.yml run re-discovers it and recreates the ranks).

The state lives in a JSON file that the loop re-reads on every poll, so the playbooks can change it
(``stop.yml`` writes ``stopped``; ``site.yml`` clears ``given_up``) and a reboot keeps it.
``roles/self_heal/files/supervisor.py`` runs the loop on the head, on its plain python3.
"""
from __future__ import annotations

import http.client
import ipaddress
import json
import os
import re
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ansible_collections.sparkops.glm53.plugins.module_utils import fabric, memory_budget, run_lock
from ansible_collections.sparkops.glm53.plugins.module_utils.health import (
    Canary,
    ContainerState,
    HealthConfig,
    HealthIO,
    HealthWaiter,
    HttpResult,
    Rank,
    api_headers,
    docker_inspect_argv,
    parse_inspect,
    remote_argv,
)

PHASE_WATCHING = "watching"
PHASE_RECOVERING = "recovering"
PHASE_BACKOFF = "backoff"
PHASE_WAITING = "waiting"
PHASE_PAUSED = "paused"
PHASE_GIVEN_UP = "given_up"
PHASE_STOPPED = "stopped"
PHASE_DISABLED = "disabled"
# Written by the playbooks (stop.yml, site.yml with glm53_self_heal false) or by a give-up: the supervisor
# never leaves them by itself, and never writes the state file while in one (the playbooks own it then).
TERMINAL_PHASES = frozenset({PHASE_GIVEN_UP, PHASE_STOPPED, PHASE_DISABLED})

ACTION_NONE = "none"
ACTION_RECOVER = "recover"
ACTION_GIVE_UP = "give_up"

RECOVERIES_KEPT = 10
# Unreachable or unknown: the node (its sshd or dockerd) does not answer, so nothing can be restarted there.
NO_ANSWER_STATES = frozenset({"unreachable", "unknown"})


@dataclass(frozen=True)
class Policy:
    """The settings ``glm53_self_heal_*`` (seconds unless said otherwise). The defaults are what
    roles/self_heal/tasks/install.yml renders from the argument spec's (test_settings_single_source.py)."""

    grace_s: float = 60.0
    poll_s: float = 10.0
    backoff_s: float = 30.0
    backoff_max_s: float = 600.0
    max_attempts: int = 3
    stable_s: float = 600.0
    ready_timeout_s: float = 3600.0
    teardown_s: int = 5

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Policy":
        default = cls()
        return cls(**{name: type(getattr(default, name))(data[name]) for name in asdict(default) if name in data})


@dataclass
class State:
    """What the supervisor knows across polls and reboots (the JSON file on the head)."""

    phase: str = PHASE_WATCHING
    reason: str = ""
    # Recoveries started since the group last served for stable_s in a row.
    attempts: int = 0
    healthy_since: Optional[float] = None
    api_down_since: Optional[float] = None
    last_attempt_end: Optional[float] = None
    recoveries: List[Dict[str, Any]] = field(default_factory=list)
    updated: float = 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "State":
        known = {name: data[name] for name in asdict(cls()) if name in data and name != "recoveries"}
        state = cls(**known)
        recoveries = data.get("recoveries")
        state.recoveries = [dict(item) for item in recoveries if isinstance(item, Mapping)] \
            if isinstance(recoveries, list) else []
        state.attempts = int(state.attempts or 0)
        return state

    def to_dict(self) -> Dict[str, Any]:
        data = asdict(self)
        data["summary"] = summary(self)
        return data


@dataclass(frozen=True)
class Observation:
    now: float
    ranks: Sequence[Tuple[Rank, ContainerState]]
    api_ok: bool
    api_detail: str = ""
    # Who else holds the run lock (a site.yml run), empty when it is free or ours.
    lock_holder: str = ""


@dataclass(frozen=True)
class Decision:
    action: str
    state: State
    trigger: str = ""


def backoff_delay(attempts: int, policy: Policy) -> float:
    """Seconds to wait before the next recovery after ``attempts`` recoveries in a row: none before the
    first, then backoff_s doubling each time, never more than backoff_max_s."""
    if attempts <= 0:
        return 0.0
    return float(min(policy.backoff_max_s, policy.backoff_s * 2 ** min(attempts - 1, 32)))


def _with(state: State, now: float, **changes: Any) -> State:
    return replace(state, updated=now, recoveries=list(state.recoveries), **changes)


def _rank_text(rank: Rank, container: ContainerState) -> str:
    return "rank %d on node %s: container %s %s" % (rank.rank, rank.node, rank.container, container.describe())


def decide(obs: Observation, state: State, policy: Policy) -> Decision:
    """What to do after one poll. Every branch is a row of docs/self-healing.md's behaviour table."""
    now = obs.now
    if state.phase in TERMINAL_PHASES:
        return Decision(ACTION_NONE, state)
    if obs.lock_holder:
        return Decision(ACTION_NONE, _with(state, now, phase=PHASE_PAUSED, api_down_since=None, healthy_since=None,
                                           reason="paused while another run holds the run lock: " + obs.lock_holder))
    missing = [(r, c) for r, c in obs.ranks if c.status == "missing"]
    if missing:
        return Decision(ACTION_NONE, _with(state, now, phase=PHASE_WAITING, healthy_since=None, reason=(
            "nothing to restart: %s (removed by hand or by a failed site.yml); re-run site.yml"
            % "; ".join(_rank_text(r, c) for r, c in missing))))
    silent = [(r, c) for r, c in obs.ranks if c.status in NO_ANSWER_STATES]
    if silent:
        return Decision(ACTION_NONE, _with(state, now, phase=PHASE_WAITING, healthy_since=None, reason=(
            "waiting for %s to answer (a node rebooting, or its sshd/dockerd down) before re-forming the group"
            % "; ".join("node %s: %s" % (r.node, c.describe()) for r, c in silent))))

    down = [(r, c) for r, c in obs.ranks if not c.running]
    if not down and obs.api_ok:
        healthy_since = state.healthy_since if state.healthy_since is not None else now
        attempts = 0 if now - healthy_since >= policy.stable_s else state.attempts
        return Decision(ACTION_NONE, _with(state, now, phase=PHASE_WATCHING, healthy_since=healthy_since,
                                           api_down_since=None, attempts=attempts, reason="serving"))
    if not down:
        since = state.api_down_since if state.api_down_since is not None else now
        down_for = now - since
        detail = obs.api_detail or "no answer"
        if down_for < policy.grace_s:
            return Decision(ACTION_NONE, _with(state, now, phase=PHASE_WATCHING, api_down_since=since, reason=(
                "every rank runs but /health fails for %d s (%s); the group is restarted after %d s "
                "(glm53_self_heal_grace)" % (down_for, detail, policy.grace_s))))
        trigger = "/health failed for %d s (%s) while every rank runs (glm53_self_heal_grace %d s)" % (
            down_for, detail, policy.grace_s)
    else:
        since = None
        trigger = "; ".join(_rank_text(r, c) for r, c in down)

    broken = _with(state, now, healthy_since=None, api_down_since=since)
    if state.attempts >= policy.max_attempts:
        last = state.recoveries[-1].get("detail", "") if state.recoveries else ""
        return Decision(ACTION_GIVE_UP, replace(broken, phase=PHASE_GIVEN_UP, reason=(
            "gave up after %d recoveries in a row without %d s of service (glm53_self_heal_max_attempts); "
            "now: %s; last recovery: %s. Every rank is stopped and stays stopped (reboots included): read "
            "playbooks/logs.yml, fix the cause, then re-run site.yml"
            % (state.attempts, policy.stable_s, trigger, last or "none"))), trigger)
    ready_at = (state.last_attempt_end if state.last_attempt_end is not None else now) + backoff_delay(
        state.attempts, policy)
    if now < ready_at:
        return Decision(ACTION_NONE, replace(broken, phase=PHASE_BACKOFF, reason=(
            "recovery %d of %d in %d s (back-off after %d in a row): %s"
            % (state.attempts + 1, policy.max_attempts, ready_at - now, state.attempts, trigger))), trigger)
    return Decision(ACTION_RECOVER, replace(broken, phase=PHASE_RECOVERING, reason="recovery %d of %d: %s" % (
        state.attempts + 1, policy.max_attempts, trigger)), trigger)


def record_recovery(state: State, trigger: str, started: float, ended: float, ok: bool, detail: str,
                    memory: Optional[Sequence[Mapping[str, Any]]] = None,
                    fabric_report: Optional[Sequence[Mapping[str, Any]]] = None, give_up: bool = False) -> State:
    """The state after one recovery ran (its attempt already counted when it started); ``memory`` is its
    memory step's report per node, kept with it so status shows a drop that was skipped, ``fabric_report``
    its GID re-check per node. ``give_up``: a failure no retry can fix (a moved GID index) ends in given_up."""
    entry: Dict[str, Any] = {"trigger": trigger, "started": round(started, 3), "seconds": round(ended - started, 1),
                             "ok": ok, "detail": detail}
    if memory:
        entry["memory"] = [dict(item) for item in memory]
    if fabric_report:
        entry["fabric"] = [dict(item) for item in fabric_report]
    recoveries = (state.recoveries + [entry])[-RECOVERIES_KEPT:]
    if ok:
        return replace(state, phase=PHASE_WATCHING, reason="serving", healthy_since=ended, api_down_since=None,
                       last_attempt_end=ended, recoveries=recoveries, updated=ended)
    if give_up:
        return replace(state, phase=PHASE_GIVEN_UP, reason=(
            "gave up at recovery %d without retrying: %s. Every rank is stopped and stays stopped (reboots "
            "included) until site.yml runs" % (state.attempts, detail)), healthy_since=None, api_down_since=None,
            last_attempt_end=ended, recoveries=recoveries, updated=ended)
    return replace(state, phase=PHASE_BACKOFF, reason="recovery %d failed: %s" % (state.attempts, detail),
                   healthy_since=None, api_down_since=None, last_attempt_end=ended, recoveries=recoveries,
                   updated=ended)


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b|\berror\b", re.IGNORECASE)


def evidence_lines(log_tail: Sequence[str], errors: int = 3) -> List[str]:
    """What a give-up reason quotes from a dead rank's log: its first error lines (the root cause of a
    Python traceback is near its top; the bottom is the generic re-raise) and its last line."""
    lines = [line.strip() for line in log_tail if line.strip()]
    found: List[str] = []
    for line in lines:
        if _ERROR_LINE.search(line) and line not in found:
            found.append(line)
    picked = found[:errors]
    if lines and lines[-1] not in picked:
        picked.append(lines[-1])
    return [line[:300] for line in picked]


def _stamp(when: Optional[float]) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when)) if when is not None else "?"


def summary(state: State) -> str:
    """One line for playbooks/status.yml."""
    text = "%s since %s: %s" % (state.phase, _stamp(state.updated), state.reason or "-")
    if state.recoveries:
        last = state.recoveries[-1]
        text += " | last recovery %s at %s took %s s (%s)" % (
            "ok" if last.get("ok") else "FAILED", _stamp(last.get("started")), last.get("seconds"),
            last.get("trigger", "?"))
        skipped = [str(item.get("node")) for item in last.get("memory") or []
                   if isinstance(item, Mapping) and item.get("drop") == "skipped"]
        if skipped:
            text += " | page cache NOT dropped before it on %s (why: state.json, recoveries[-1].memory)" % (
                ", ".join(skipped))
    return text


# --------------------------------------------------------------------------- memory before a restart


def _flag(value: Any) -> bool:
    """A bool from JSON that Ansible rendered: true/false, or their words."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "on", "1")
    return bool(value)


def budget_request(data: Mapping[str, Any]) -> memory_budget.BudgetRequest:
    """roles/glm53/vars/main.yml's _glm53_memory_request for one node, as install.yml wrote it."""
    return memory_budget.BudgetRequest(
        gpu=_flag(data["gpu"]), gpu_memory_utilization=float(data["gpu_memory_utilization"]),
        kv_cache_memory_bytes=int(data.get("kv_cache_memory_bytes") or 0),
        max_model_len=int(data.get("max_model_len") or 0), weights_bytes=int(data.get("weights_bytes") or 0),
        overhead_bytes=int(data.get("overhead_bytes") or 0),
        kv_bytes_per_token=int(data.get("kv_bytes_per_token") or 0),
        reserve_bytes=int(data.get("reserve_bytes") or 0))


@dataclass(frozen=True)
class NodeMemory:
    """One node's memory step before a restart: preflight's budget request, and how to drop its page cache."""

    request: memory_budget.BudgetRequest
    # The root-owned drop script (through `sudo -n` unless the SSH user is root); empty when there is none.
    drop_argv: Tuple[str, ...] = ()
    # Why there is none although glm53_drop_page_cache is on (install.yml could not become root there).
    drop_refused: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "NodeMemory":
        return cls(request=budget_request(data["request"]), drop_argv=tuple(str(a) for a in data.get("drop") or ()),
                   drop_refused=str(data.get("drop_refused") or ""))


@dataclass(frozen=True)
class MemoryConfig:
    drop_page_cache: bool
    nodes: Mapping[str, NodeMemory]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MemoryConfig":
        nodes = data.get("nodes") or {}
        return cls(drop_page_cache=_flag(data.get("drop_page_cache")),
                   nodes={str(node): NodeMemory.from_dict(item) for node, item in nodes.items()})


@dataclass(frozen=True)
class NodeMemoryReport:
    """What the memory step found on one node."""

    node: str
    drop: memory_budget.DropOutcome
    problems: Tuple[str, ...]
    line: str

    def as_dict(self) -> Dict[str, Any]:
        return {"node": self.node, "drop": self.drop.status, "drop_reason": self.drop.reason,
                "problems": list(self.problems), "summary": self.line}


def judge_node_memory(node: str, spec: NodeMemory, drop_page_cache: bool, drop: memory_budget.DropOutcome
                      ) -> NodeMemoryReport:
    """The preflight budget (memory.yml's) on what the node has after the drop: a drop that ran shows in the
    meminfo read after it, and one that was skipped must not be counted as done."""
    mem = drop.after or drop.before
    request = replace(spec.request, page_cache_dropped=False)
    budget = memory_budget.plan_memory(mem, request)
    line = memory_budget.summary(node, mem, request, budget)
    if drop_page_cache:
        line += "; " + drop.describe()
    return NodeMemoryReport(node, drop, tuple(budget.problems), line)


def memory_failure(reports: Sequence[NodeMemoryReport]) -> str:
    """The recovery's failure when some node's memory cannot take its rank: node, what it has against what
    the settings ask, and the fix; empty when every node fits."""
    parts = []
    for report in reports:
        if not report.problems:
            continue
        text = "on node %s, %s" % (report.node, " | ".join(report.problems))
        if report.drop.status == "skipped":
            text += " (page cache not dropped: %s)" % report.drop.reason
        parts.append(text)
    if not parts:
        return ""
    nodes = ", ".join(r.node for r in reports if r.problems)
    return ("not starting the ranks, the memory settings do not fit: %s. Fix: free memory on %s (what else runs "
            "there: free -g, docker ps, ps aux --sort=-rss), or change the setting named and re-run site.yml; the "
            "supervisor checks again after its back-off" % ("; ".join(parts), nodes))


def memory_plan(memory: Optional[MemoryConfig]) -> str:
    """The supervisor's first log line about memory: what it will do before a restart, node by node."""
    if memory is None:
        return "before a restart: no memory check (a config from before it; re-run site.yml)"
    if not memory.drop_page_cache:
        return "before a restart: every node's memory judged with the start budget; no page-cache drop " \
               "(glm53_drop_page_cache false)"
    nodes = ["%s: `%s`" % (node, " ".join(spec.drop_argv)) if spec.drop_argv else
             "%s: SKIPPED (%s)" % (node, spec.drop_refused or "no drop command") for node, spec in memory.nodes.items()]
    return "before a restart: page cache dropped (%s), then every node's memory judged with the start budget" % (
        "; ".join(nodes))


# --------------------------------------------------------------------------- fabric before a restart

SYS_INFINIBAND = "/sys/class/infiniband"


@dataclass(frozen=True)
class FabricRail:
    """One rail as the fabric stage chose it: its RDMA port, and the netdev and address its RoCE v2 GID maps."""

    hca: str
    port: int
    netdev: str
    address: ipaddress.IPv4Address

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FabricRail":
        return cls(hca=str(data["hca"]), port=int(data["port"]), netdev=str(data["netdev"]),
                   address=ipaddress.IPv4Address(str(data["address"])))

    def paths(self, index: int) -> Tuple[str, str, str]:
        """The GID slot's sysfs files: the GID, its type, its netdev."""
        base = "%s/%s/ports/%d" % (SYS_INFINIBAND, self.hca, self.port)
        return ("%s/gids/%d" % (base, index), "%s/gid_attrs/types/%d" % (base, index),
                "%s/gid_attrs/ndevs/%d" % (base, index))

    def expected(self) -> str:
        return "%s (%s on %s)" % (fabric.ipv4_mapped_gid(self.address).exploded, self.address, self.netdev)


@dataclass(frozen=True)
class NodeFabric:
    """One node's NCCL_IB_GID_INDEX (one number for all its rails) and its rails, from the fabric stage."""

    gid_index: int
    rails: Tuple[FabricRail, ...]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "NodeFabric":
        return cls(gid_index=int(data["gid_index"]), rails=tuple(FabricRail.from_dict(r) for r in data["rails"]))

    def read_argv(self) -> List[str]:
        """One command reading every rail's slot: grep prints each readable file as PATH:VALUE (sysfs paths
        hold no colon), and -s keeps quiet about a missing file or an empty slot's EINVAL."""
        return ["grep", "-Hs", "."] + [path for rail in self.rails for path in rail.paths(self.gid_index)]


def parse_gid_read(spec: NodeFabric, output: str) -> List[Tuple[FabricRail, Optional[fabric.GidEntry]]]:
    """Each rail's GID slot from ``read_argv``'s output; None where the slot's GID file is not there at all."""
    values: Dict[str, str] = {}
    for line in output.splitlines():
        path, sep, value = line.partition(":")
        if sep:
            values[path] = value.strip()
    found: List[Tuple[FabricRail, Optional[fabric.GidEntry]]] = []
    for rail in spec.rails:
        gid, gid_type, ndev = rail.paths(spec.gid_index)
        found.append((rail, fabric.gid_entry(spec.gid_index, values.get(gid), values.get(gid_type), values.get(ndev))
                      if gid in values else None))
    return found


def gid_problems(node: str, spec: NodeFabric, output: str) -> List[str]:
    """What is wrong with the GID slot each rail's ranks would use (fabric.gid_problem, the fabric stage's own
    test), one line per rail naming node, port, index, what it holds now and what was recorded."""
    problems = []
    for rail, entry in parse_gid_read(spec, output):
        where = "node %s: %s port %d GID index %d" % (node, rail.hca, rail.port, spec.gid_index)
        if entry is None:
            problems.append("%s does not exist (no %s), expected %s" % (where, rail.paths(spec.gid_index)[0],
                                                                        rail.expected()))
            continue
        problem = fabric.gid_problem(entry, rail.address, rail.netdev)
        if problem:
            # gid_problem names the expected GID only when another one is there.
            expected = fabric.ipv4_mapped_gid(rail.address).exploded
            problems.append("%s %s%s" % (where, problem, "" if expected in problem else
                                         ", expected %s" % rail.expected()))
    return problems


def fabric_failure(problems: Sequence[str]) -> str:
    """The recovery's failure when some node's GID index moved: empty when every rail's slot still holds its GID."""
    if not problems:
        return ""
    return ("not starting the ranks, the RoCE GID index they were created with is stale (GID indices move after "
            "reboots; NCCL on it fails or hangs): %s. Fix: re-run site.yml: the fabric stage re-discovers the GID "
            "index and the ranks are recreated with it" % "; ".join(problems))


def fabric_plan(nodes: Optional[Mapping[str, NodeFabric]]) -> str:
    """The supervisor's first log line about the fabric."""
    if not nodes:
        return "before a restart: no GID re-check (RDMA off, or a config from before it)"
    return "before a restart: the GID index of every rail re-checked (%s)" % "; ".join(
        "%s: index %d on %s" % (node, spec.gid_index, ", ".join("%s:%d" % (r.hca, r.port) for r in spec.rails))
        for node, spec in nodes.items())


# --------------------------------------------------------------------------- the loop


@dataclass
class SupervisorConfig:
    url: str
    served_model_name: str
    ranks: List[Rank]
    state_path: str
    lock_path: str
    # The run lock's holder token, roles/self_heal/vars/main.yml's; stop.yml releases a lock left with it.
    lock_token: str
    owner: str
    # The supervisor's container on the head, recorded in the run lock it takes: a site.yml run breaks that
    # lock when the container no longer runs (removed mid-recovery) instead of waiting for it.
    container: str = ""
    policy: Policy = field(default_factory=Policy)
    canary: Canary = field(default_factory=Canary)
    log_tail: int = 40
    command_timeout: float = 60.0
    # The page-cache drop and memory budget before a restart; None (a config from before it) skips the step.
    memory: Optional[MemoryConfig] = None
    # Per node, the GID index and rails its ranks were created with; empty (RDMA off, or a config from before
    # the re-check) skips the re-check.
    fabric: Mapping[str, NodeFabric] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SupervisorConfig":
        config = cls(url=str(data["url"]), served_model_name=str(data["served_model_name"]),
                     ranks=sorted((Rank.from_dict(r) for r in data["ranks"]), key=lambda r: r.rank),
                     state_path=str(data["state_path"]), lock_path=str(data["lock_path"]),
                     lock_token=str(data["lock_token"]),
                     owner=str(data.get("owner") or "glm53 self-healing supervisor"),
                     container=str(data.get("container") or ""),
                     policy=Policy.from_dict(data.get("policy") or {}), canary=Canary.from_dict(data.get("canary")),
                     log_tail=int(data.get("log_tail", cls.log_tail)),
                     memory=MemoryConfig.from_dict(data["memory"]) if data.get("memory") else None,
                     fabric={str(node): NodeFabric.from_dict(spec)
                             for node, spec in ((data.get("fabric") or {}).get("nodes") or {}).items()})
        missing = [r.node for r in config.ranks if config.memory and r.node not in config.memory.nodes]
        if missing:
            raise ValueError("the supervisor's config has no memory budget for node(s) %s: re-run site.yml"
                             % ", ".join(missing))
        missing = [r.node for r in config.ranks if config.fabric and r.node not in config.fabric]
        if missing:
            raise ValueError("the supervisor's config has no fabric (GID index) for node(s) %s: re-run site.yml"
                             % ", ".join(missing))
        return config


def load_state(path: str) -> State:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return State()
    return State.from_dict(data) if isinstance(data, dict) else State()


def save_state(path: str, state: State) -> None:
    """Atomically, so status.yml never reads half a document."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".state-", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(state.to_dict(), handle, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _shape(reason: str) -> str:
    """A reason without its numbers: a count of seconds ticking is not news for the log."""
    return re.sub(r"[0-9]+", "#", reason)


class Supervisor:
    def __init__(self, config: SupervisorConfig, io: HealthIO, log: Callable[[str], None],
                 wall: Callable[[], float] = time.time, boot_id: Callable[[], str] = run_lock.read_boot_id) -> None:
        self.cfg = config
        self.io = io
        self.log = log
        # Wall-clock time, not io.clock: the state's times must mean the same after a reboot.
        self.wall = wall
        self.boot_id = boot_id
        self.last_logged = ""
        # The memory step's report of the recovery in progress (kept with it in the state file).
        self.memory_report: List[NodeMemoryReport] = []
        # The GID re-check's report of the recovery in progress, and whether it found an index moved.
        self.fabric_report: List[Dict[str, Any]] = []
        self.fabric_stale = False

    @property
    def head(self) -> Rank:
        return self.cfg.ranks[0]

    # -- observing
    def inspect(self, rank: Rank) -> ContainerState:
        rc, out, err = self.io.run(docker_inspect_argv(rank), self.cfg.command_timeout, False)
        return parse_inspect(rc, out, err, via_ssh=bool(rank.ssh))

    def lock_holder(self, now: float) -> str:
        state = run_lock.read_state(self.cfg.lock_path, now)
        if not state.held or (state.holder is not None and state.holder.token == self.cfg.lock_token):
            return ""
        return run_lock.describe_state(state, now)

    def observe(self) -> Observation:
        now = self.wall()
        ranks = [(rank, self.inspect(rank)) for rank in self.cfg.ranks]
        health = self.io.http("GET", self.cfg.url.rstrip("/") + "/health", api_headers(None), None, 10.0)
        return Observation(now, ranks, health.status == 200, health.describe(), self.lock_holder(now))

    # -- acting
    def command(self, rank: Rank, *argv: str) -> Tuple[int, str]:
        rc, out, err = self.io.run(remote_argv(list(argv), rank.ssh), self.cfg.command_timeout, False)
        return rc, " ".join((err or out).split())[:300]

    def stop_group(self) -> None:
        """Head first (it holds the API), then the workers; already stopped ranks are left as they are."""
        for rank in self.cfg.ranks:
            rc, detail = self.command(rank, "docker", "stop", "--time", str(self.cfg.policy.teardown_s), rank.container)
            if rc != 0:
                self.log("stopping rank %d on node %s: %s" % (rank.rank, rank.node, detail))

    def api_key(self) -> Optional[str]:
        """The head rank's own VLLM_API_KEY: read where it already is, so no second copy sits on disk."""
        rc, out, _err = self.io.run(["docker", "inspect", "-f", "{{json .Config.Env}}", self.head.container],
                                    self.cfg.command_timeout, False)
        try:
            env = json.loads(out) if rc == 0 else []
        except ValueError:
            env = []
        for item in env or []:
            if isinstance(item, str) and item.startswith("VLLM_API_KEY="):
                return item.split("=", 1)[1] or None
        return None

    def read_meminfo(self, rank: Rank) -> memory_budget.MemInfo:
        """The node's /proc/meminfo, read where the rank runs; raises ValueError saying why it could not."""
        rc, out, err = self.io.run(remote_argv(["cat", "/proc/meminfo"], rank.ssh), self.cfg.command_timeout, False)
        if rc != 0:
            raise ValueError("cannot read /proc/meminfo on node %s (exit %d): %s"
                             % (rank.node, rc, " ".join((err or out).split())[:300]))
        try:
            return memory_budget.parse_meminfo(out)
        except ValueError as exc:
            raise ValueError("node %s: %s" % (rank.node, exc)) from exc

    def drop_page_cache(self, rank: Rank, spec: NodeMemory) -> memory_budget.DropOutcome:
        """Run the node's drop script (its one root right) and read memory again; a refusal is `skipped`."""
        memory = self.cfg.memory
        before = self.read_meminfo(rank)
        if memory is None or not memory.drop_page_cache:
            return memory_budget.DropOutcome("not asked", "glm53_drop_page_cache is false", before)
        if not spec.drop_argv:
            return memory_budget.DropOutcome("skipped", spec.drop_refused or "no drop command configured", before)
        rc, detail = self.command(rank, *spec.drop_argv)
        command = " ".join(spec.drop_argv)
        if rc != 0:
            return memory_budget.DropOutcome("skipped", (
                "`%s` failed (exit %d: %s); the supervisor runs as the SSH user and its only root right is that "
                "script (roles/self_heal installs it and its sudoers drop-in with become): re-run site.yml with "
                "become working on %s, or set glm53_drop_page_cache=false"
                % (command, rc, detail or "no output", rank.node)), before)
        return memory_budget.DropOutcome("dropped", "ran " + command, before, self.read_meminfo(rank))

    def free_memory(self) -> str:
        """With every rank stopped: drop each node's clean page cache and judge its memory with preflight's
        budget. Every node is checked, so the failure names them all; empty when each one fits."""
        self.memory_report = []
        if self.cfg.memory is None:
            return ""
        for rank in self.cfg.ranks:
            spec = self.cfg.memory.nodes[rank.node]
            try:
                drop = self.drop_page_cache(rank, spec)
            except ValueError as exc:
                return "not starting the ranks: %s" % exc
            report = judge_node_memory(rank.node, spec, self.cfg.memory.drop_page_cache, drop)
            self.memory_report.append(report)
            self.log("memory: " + report.line)
        return memory_failure(self.memory_report)

    def check_fabric(self) -> str:
        """With every rank stopped: read, on every node, the GID slot each rail's ranks will use and compare it
        with what the fabric stage chose. Every node is read, so the failure names them all; empty when each
        slot still holds its GID. A moved index sets ``fabric_stale``; a node that cannot be read does not."""
        self.fabric_report = []
        self.fabric_stale = False
        unreadable: List[str] = []
        problems: List[str] = []
        for rank in self.cfg.ranks:
            spec = self.cfg.fabric.get(rank.node)
            if spec is None:
                continue
            rc, out, err = self.io.run(remote_argv(spec.read_argv(), rank.ssh), self.cfg.command_timeout, False)
            # grep: 0 all read, 1 none matched, 2 some file missing; anything else (ssh's 255) read nothing.
            if rc not in (0, 1, 2):
                unreadable.append("cannot read the GID table on node %s (exit %d): %s"
                                  % (rank.node, rc, " ".join((err or out).split())[:300]))
                self.fabric_report.append({"node": rank.node, "gid_index": spec.gid_index, "problems": unreadable[-1:]})
                continue
            found = gid_problems(rank.node, spec, out)
            problems += found
            self.fabric_report.append({"node": rank.node, "gid_index": spec.gid_index, "problems": found})
            self.log("fabric: " + ("; ".join(found) if found else "node %s: GID index %d unchanged on %s" % (
                rank.node, spec.gid_index, ", ".join("%s:%d" % (r.hca, r.port) for r in spec.rails))))
        if problems:
            self.fabric_stale = True
            return fabric_failure(problems)
        return "not starting the ranks: %s" % "; ".join(unreadable) if unreadable else ""

    def recover(self) -> Tuple[bool, str]:
        """Stop every rank, re-check the GID index, free and judge memory, start the workers, then the head, then
        wait for the API and the canary."""
        self.fabric_report, self.fabric_stale = [], False
        key = self.api_key()
        self.stop_group()
        # A moved GID index is given up at once (attempt() reads fabric_stale): no retry moves it back, and only
        # site.yml's fabric stage re-discovers it and recreates the ranks with the new NCCL_IB_GID_INDEX.
        stale = self.check_fabric()
        if stale:
            self.memory_report = []
            return False, stale
        # Memory that does not fit is retried after the back-off, not given up at once: a stopped engine's
        # memory (on a GB10 the driver's unified-memory teardown) and another program's use can be gone by
        # then, and the check costs no engine start. A lasting shortage ends in given_up with this reason.
        no_room = self.free_memory()
        if no_room:
            return False, no_room
        for rank in self.cfg.ranks[1:] + self.cfg.ranks[:1]:
            rc, detail = self.command(rank, "docker", "start", rank.container)
            if rc != 0:
                self.stop_group()
                return False, "could not start rank %d on node %s: %s" % (rank.rank, rank.node, detail)
            self.log("started rank %d on node %s" % (rank.rank, rank.node))
        waiter = HealthWaiter(HealthConfig(
            url=self.cfg.url, served_model_name=self.cfg.served_model_name, ranks=self.cfg.ranks, api_key=key,
            timeout=self.cfg.policy.ready_timeout_s, poll_interval=min(5.0, self.cfg.policy.poll_s),
            log_tail=self.cfg.log_tail, canary=self.cfg.canary), self.io)
        outcome = waiter.run()
        if not outcome.failed:
            return True, "serving; canary: %s" % " ".join(str(outcome.result.get("canary_text", "")).split())[:200]
        self.stop_group()
        lines = evidence_lines(outcome.result.get("log_tail") or [])
        return False, outcome.msg + (" | " + " | ".join(lines) if lines else "")

    def attempt(self, decision: Decision) -> State:
        """One recovery under the run lock, so a site.yml run waits for it (and it for a site.yml run)."""
        started = self.wall()
        # The boot id and container let a site.yml run tell this holder is gone after a reboot or a removal.
        holder = run_lock.Holder(token=self.cfg.lock_token, owner=self.cfg.owner, playbook="self-healing recovery",
                                 since=started, boot_id=self.boot_id(), container=self.cfg.container)
        acquired, _seen = run_lock.try_acquire(self.cfg.lock_path, holder, started)
        if not acquired:
            return replace(decision.state, phase=PHASE_PAUSED, reason="paused: another run took the run lock")
        state = replace(decision.state, attempts=decision.state.attempts + 1)
        save_state(self.cfg.state_path, state)
        self.log("%s" % state.reason)
        try:
            ok, detail = self.recover()
        finally:
            run_lock.release(self.cfg.lock_path, self.cfg.lock_token, self.wall())
        ended = self.wall()
        self.log("recovery %s after %.1f s: %s" % ("succeeded" if ok else "FAILED", ended - started, detail))
        return record_recovery(state, decision.trigger, started, ended, ok, detail,
                               [report.as_dict() for report in self.memory_report], self.fabric_report,
                               give_up=not ok and self.fabric_stale)

    def poll(self) -> Decision:
        state = load_state(self.cfg.state_path)
        if state.phase in TERMINAL_PHASES:
            return Decision(ACTION_NONE, state)
        decision = decide(self.observe(), state, self.cfg.policy)
        new = decision.state
        if decision.action == ACTION_RECOVER:
            new = self.attempt(decision)
        elif decision.action == ACTION_GIVE_UP:
            self.stop_group()
            self.log(new.reason)
        line = "%s: %s" % (new.phase, new.reason)
        if _shape(line) != self.last_logged:
            self.log(line)
            self.last_logged = _shape(line)
        # While a site.yml run holds the lock, the state file is the run's: it may reset it at its end, and
        # a write from here, made from what was read before, would undo that.
        if new.phase != PHASE_PAUSED:
            save_state(self.cfg.state_path, new)
        return Decision(decision.action, new, decision.trigger)

    def run(self, polls: Optional[int] = None) -> None:
        run_lock.break_if_held_by(self.cfg.lock_path, self.cfg.lock_token, self.wall())
        done = 0
        while polls is None or done < polls:
            decision = self.poll()
            done += 1
            if decision.action == ACTION_NONE:
                self.io.sleep(self.cfg.policy.poll_s)


def http_client(method: str, url: str, headers: Mapping[str, str], body: Optional[bytes], timeout: float) -> HttpResult:
    """health.Http on the standard library alone: the supervisor's python3 has no Ansible to import."""
    parts = urllib.parse.urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        connection.request(method, parts.path + ("?" + parts.query if parts.query else ""), body=body,
                           headers=dict(headers))
        response = connection.getresponse()
        return HttpResult(response.status, response.read().decode("utf-8", "replace"))
    except (OSError, http.client.HTTPException) as exc:
        return HttpResult(0, "", "%s: %s" % (type(exc).__name__, exc))
    finally:
        connection.close()
