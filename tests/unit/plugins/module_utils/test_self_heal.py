# SPDX-License-Identifier: MIT
"""self_heal: every observed state maps to one action, the back-off arithmetic, and the supervisor loop
driven against a scripted two-node cluster (docker and ssh answered by a fake runner, vLLM by a fake HTTP)."""
from __future__ import annotations

import ipaddress
import json
import shlex
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from ansible_collections.sparkops.glm53.plugins.module_utils import run_lock
from ansible_collections.sparkops.glm53.plugins.module_utils import self_heal as sh
from ansible_collections.sparkops.glm53.plugins.module_utils.health import ContainerState, HealthIO, HttpResult, Rank

HEAD = Rank(0, "spark1", "glm53-rank0")
WORKER = Rank(1, "spark2", "glm53-rank1", "root@10.0.0.2")
POLICY = sh.Policy(grace_s=60, poll_s=10, backoff_s=30, backoff_max_s=600, max_attempts=3, stable_s=600,
                   ready_timeout_s=120, teardown_s=5)
RUNNING = ContainerState("running", 0)
EXITED = ContainerState("exited", 137)


def obs(head: ContainerState = RUNNING, worker: ContainerState = RUNNING, api_ok: bool = True, now: float = 1000.0,
        lock: str = "") -> sh.Observation:
    return sh.Observation(now, [(HEAD, head), (WORKER, worker)], api_ok, "HTTP 200" if api_ok else "no answer", lock)


# --------------------------------------------------------------------------- back-off


@pytest.mark.parametrize("attempts,delay", [(0, 0), (1, 30), (2, 60), (3, 120), (4, 240), (5, 480), (6, 600),
                                            (10, 600), (10_000, 600)])
def test_backoff_doubles_from_the_first_retry_and_is_capped(attempts: int, delay: float) -> None:
    assert sh.backoff_delay(attempts, POLICY) == delay


def test_backoff_of_zero_retries_at_once() -> None:
    assert sh.backoff_delay(3, sh.Policy(backoff_s=0, backoff_max_s=0)) == 0


# --------------------------------------------------------------------------- decide: one row per state


@pytest.mark.parametrize("phase", sorted(sh.TERMINAL_PHASES))
def test_terminal_phases_are_never_left_by_the_supervisor(phase: str) -> None:
    state = sh.State(phase=phase, reason="stopped by playbooks/stop.yml")
    for observation in (obs(), obs(worker=EXITED, api_ok=False)):
        decision = sh.decide(observation, state, POLICY)
        assert (decision.action, decision.state) == (sh.ACTION_NONE, state)


def test_a_site_run_holding_the_lock_pauses_the_supervisor_whatever_it_sees() -> None:
    decision = sh.decide(obs(worker=EXITED, api_ok=False, lock="alice@ctl running Deploy"), sh.State(), POLICY)
    assert decision.action == sh.ACTION_NONE
    assert decision.state.phase == sh.PHASE_PAUSED and "alice@ctl running Deploy" in decision.state.reason


def test_a_removed_rank_container_is_not_recreated() -> None:
    decision = sh.decide(obs(worker=ContainerState("missing", detail="No such object")), sh.State(), POLICY)
    assert decision.action == sh.ACTION_NONE and decision.state.phase == sh.PHASE_WAITING
    assert "rank 1 on node spark2: container glm53-rank1 missing" in decision.state.reason
    assert "re-run site.yml" in decision.state.reason


@pytest.mark.parametrize("status", ["unreachable", "unknown"])
def test_a_node_that_does_not_answer_is_waited_for_without_spending_an_attempt(status: str) -> None:
    state = sh.State(attempts=1)
    decision = sh.decide(obs(worker=ContainerState(status, detail="ssh: no route to host"), api_ok=False), state,
                         POLICY)
    assert decision.action == sh.ACTION_NONE and decision.state.phase == sh.PHASE_WAITING
    assert "node spark2" in decision.state.reason and decision.state.attempts == 1


def test_serving_is_watched_and_the_attempts_reset_only_after_stable_service() -> None:
    first = sh.decide(obs(now=1000), sh.State(attempts=2), POLICY).state
    assert (first.phase, first.healthy_since, first.attempts) == (sh.PHASE_WATCHING, 1000, 2)
    early = sh.decide(obs(now=1599), first, POLICY).state
    assert early.attempts == 2
    stable = sh.decide(obs(now=1600), early, POLICY)
    assert (stable.action, stable.state.attempts, stable.state.healthy_since) == (sh.ACTION_NONE, 0, 1000)


def test_api_down_with_every_rank_running_is_given_the_grace_period() -> None:
    state = sh.decide(obs(api_ok=False, now=1000), sh.State(), POLICY).state
    assert state.phase == sh.PHASE_WATCHING and state.api_down_since == 1000
    assert sh.decide(obs(api_ok=False, now=1059), state, POLICY).action == sh.ACTION_NONE
    late = sh.decide(obs(api_ok=False, now=1060), state, POLICY)
    assert late.action == sh.ACTION_RECOVER
    assert late.trigger == "/health failed for 60 s (no answer) while every rank runs (glm53_self_heal_grace 60 s)"
    # The API answering again clears the count.
    assert sh.decide(obs(now=1030), state, POLICY).state.api_down_since is None


@pytest.mark.parametrize("head,worker", [(RUNNING, EXITED), (EXITED, RUNNING), (EXITED, EXITED),
                                         (ContainerState("created"), RUNNING)])
def test_a_rank_not_running_recovers_the_group_at_once(head: ContainerState, worker: ContainerState) -> None:
    decision = sh.decide(obs(head=head, worker=worker, api_ok=False), sh.State(healthy_since=1.0), POLICY)
    assert decision.action == sh.ACTION_RECOVER and decision.state.phase == sh.PHASE_RECOVERING
    assert decision.state.reason.startswith("recovery 1 of 3: rank ")
    assert decision.state.healthy_since is None


def test_a_rank_death_is_named_with_its_exit_code() -> None:
    decision = sh.decide(obs(worker=EXITED), sh.State(), POLICY)
    assert decision.trigger == "rank 1 on node spark2: container glm53-rank1 exited (exit code 137)"


def test_the_next_recovery_waits_out_its_backoff() -> None:
    state = sh.State(phase=sh.PHASE_BACKOFF, attempts=2, last_attempt_end=1000.0)
    waiting = sh.decide(obs(worker=EXITED, now=1059), state, POLICY)  # 2 in a row: 60 s
    assert waiting.action == sh.ACTION_NONE and waiting.state.phase == sh.PHASE_BACKOFF
    assert waiting.state.reason.startswith("recovery 3 of 3 in 1 s (back-off after 2 in a row): rank 1")
    assert sh.decide(obs(worker=EXITED, now=1060), state, POLICY).action == sh.ACTION_RECOVER


def test_after_max_attempts_it_gives_up_naming_the_last_failure() -> None:
    state = sh.State(attempts=3, last_attempt_end=0.0, recoveries=[
        {"trigger": "x", "started": 1, "seconds": 3, "ok": False, "detail": "rank 0 exited (exit code 1) | OSError"}])
    decision = sh.decide(obs(head=ContainerState("exited", 1), api_ok=False), state, POLICY)
    assert decision.action == sh.ACTION_GIVE_UP and decision.state.phase == sh.PHASE_GIVEN_UP
    reason = decision.state.reason
    assert reason.startswith("gave up after 3 recoveries in a row without 600 s of service "
                             "(glm53_self_heal_max_attempts)")
    assert "last recovery: rank 0 exited (exit code 1) | OSError" in reason and "re-run site.yml" in reason
    # And stays given up.
    assert sh.decide(obs(), decision.state, POLICY).action == sh.ACTION_NONE


def test_record_recovery_success_and_failure() -> None:
    state = sh.State(phase=sh.PHASE_RECOVERING, attempts=1)
    ok = sh.record_recovery(state, "rank 1 exited", 100.0, 190.04, True, "serving")
    assert (ok.phase, ok.healthy_since, ok.last_attempt_end, ok.attempts) == (sh.PHASE_WATCHING, 190.04, 190.04, 1)
    assert ok.recoveries == [{"trigger": "rank 1 exited", "started": 100.0, "seconds": 90.0, "ok": True,
                              "detail": "serving"}]
    bad = sh.record_recovery(state, "t", 100.0, 110.0, False, "canary failed")
    assert bad.phase == sh.PHASE_BACKOFF and bad.reason == "recovery 1 failed: canary failed"
    many = state
    for i in range(sh.RECOVERIES_KEPT + 3):
        many = sh.record_recovery(many, "t%d" % i, i, i + 1, False, "d")
    assert len(many.recoveries) == sh.RECOVERIES_KEPT and many.recoveries[-1]["trigger"] == "t12"


def test_evidence_quotes_the_first_errors_of_a_traceback_and_the_last_line() -> None:
    tail = ["INFO loading weights", "Traceback (most recent call last):", '  File "loader.py", line 3, in load',
            "safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata",
            "  raise e from None", "Exception: WorkerProc initialization failed",
            "Exception: WorkerProc initialization failed",
            "", "INFO [shutdown] all workers exited"]
    assert sh.evidence_lines(tail) == [
        "safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata",
        "Exception: WorkerProc initialization failed", "INFO [shutdown] all workers exited"]
    assert sh.evidence_lines([]) == [] and sh.evidence_lines(["only line"]) == ["only line"]


def test_state_round_trips_through_json_with_its_summary(tmp_path: Path) -> None:
    state = sh.record_recovery(sh.State(attempts=1), "rank 1 exited", 0.0, 95.0, True, "serving")
    path = str(tmp_path / "state.json")
    sh.save_state(path, state)
    data = json.loads(Path(path).read_text())
    assert data["summary"] == ("watching since 1970-01-01 00:01:35 UTC: serving | last recovery ok at "
                               "1970-01-01 00:00:00 UTC took 95.0 s (rank 1 exited)")
    assert sh.load_state(path) == state
    # What a playbook writes (stop.yml) is enough; junk reads as a fresh state.
    Path(path).write_text('{"phase": "stopped", "reason": "stopped by playbooks/stop.yml", "extra": 1}')
    assert sh.load_state(path).phase == sh.PHASE_STOPPED
    Path(path).write_text("not json")
    assert sh.load_state(path) == sh.State()


def test_policy_and_config_from_the_json_site_yml_writes() -> None:
    config = sh.SupervisorConfig.from_dict({
        "url": "http://127.0.0.1:8888", "served_model_name": "m", "state_path": "/s", "lock_path": "/l",
        "lock_token": "glm53-self-heal",
        "ranks": [{"rank": 1, "node": "spark2", "container": "glm53-rank1", "ssh": "root@10.0.0.2"},
                  {"rank": 0, "node": "spark1", "container": "glm53-rank0", "ssh": None}],
        "policy": {"grace_s": "5", "max_attempts": "2", "teardown_s": 3},
        "canary": {"prompt": "hi", "max_tokens": 4}})
    assert [r.rank for r in config.ranks] == [0, 1]
    assert config.policy == sh.Policy(grace_s=5.0, max_attempts=2, teardown_s=3)
    assert config.lock_token == "glm53-self-heal"
    assert (config.canary.prompt, config.canary.max_tokens) == ("hi", 4)


# --------------------------------------------------------------------------- the loop, scripted


class FakeCluster:
    """docker on two nodes (the worker over ssh) and vLLM's API. ``start_outcome`` says what a started
    rank does: keep running, or exit with a code at once (a bad checkpoint)."""

    def __init__(self) -> None:
        self.status: Dict[str, Tuple[str, int]] = {"glm53-rank0": ("running", 0), "glm53-rank1": ("running", 0)}
        self.commands: List[Tuple[str, str, str]] = []  # (node, verb, container)
        self.start_outcome: Dict[str, Tuple[str, int]] = {}
        self.now = 1_000_000.0
        self.reachable = True

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def run(self, argv: Sequence[str], timeout: float, merge: bool) -> Tuple[int, str, str]:
        node = "spark1"
        if argv[0] == "ssh":
            if not self.reachable:
                return 255, "", "ssh: connect to host 10.0.0.2 port 22: No route to host"
            node, argv = "spark2", shlex.split(argv[-1])
        verb, name = argv[1], argv[-1]
        if name not in self.status:
            return 1, "", "Error: No such object: " + name
        if verb == "inspect" and "Config.Env" in argv[3]:
            return 0, json.dumps(["PATH=/usr/bin", "VLLM_API_KEY=sk-test"]), ""
        if verb == "inspect":
            status, code = self.status[name]
            return 0, "%s %d 2026-12-01T10:00:00.5Z\n" % (status, code), ""
        if verb == "logs":
            return 0, "INFO loading\nERROR %s failed to load the checkpoint\n" % name, ""
        self.commands.append((node, verb, name))
        if verb == "stop":
            if self.status[name][0] == "running":
                self.status[name] = ("exited", 143)
        elif verb == "start":
            self.status[name] = self.start_outcome.get(name, ("running", 0))
        return 0, name + "\n", ""

    def http(self, method: str, url: str, headers, body: Optional[bytes], timeout: float) -> HttpResult:
        if not all(s == "running" for s, _c in self.status.values()):
            return HttpResult(0, error="ConnectionRefusedError")
        if url.endswith("/health"):
            return HttpResult(200)
        assert headers.get("Authorization") == "Bearer sk-test", "the supervisor must use the head rank's key"
        if url.endswith("/v1/models"):
            return HttpResult(200, json.dumps({"data": [{"id": "m"}]}))
        return HttpResult(200, json.dumps({"choices": [{"message": {"content": "Paris."}, "finish_reason": "stop"}],
                                           "usage": {"completion_tokens": 3}}))


@pytest.fixture()
def cluster() -> FakeCluster:
    return FakeCluster()


def supervisor(cluster: FakeCluster, tmp_path: Path, **policy: float) -> Tuple[sh.Supervisor, List[str]]:
    lines: List[str] = []
    config = sh.SupervisorConfig(url="http://127.0.0.1:8888", served_model_name="m", ranks=[HEAD, WORKER],
                                 state_path=str(tmp_path / "self-heal" / "state.json"),
                                 lock_path=str(tmp_path / "run.lock"), lock_token="glm53-self-heal",
                                 owner="glm53 self-healing on spark1",
                                 policy=sh.Policy(**dict(dict(poll_s=10, ready_timeout_s=60), **policy)))
    io = HealthIO(run=cluster.run, http=cluster.http, clock=cluster.clock, sleep=cluster.sleep)
    return sh.Supervisor(config, io, lines.append, wall=cluster.clock), lines


def test_a_dead_worker_restarts_the_whole_group_workers_first_under_the_run_lock(
        cluster: FakeCluster, tmp_path: Path) -> None:
    sup, _lines = supervisor(cluster, tmp_path)
    assert sup.poll().action == sh.ACTION_NONE and cluster.commands == []
    cluster.status["glm53-rank1"] = ("exited", 137)
    seen_lock: List[Optional[str]] = []
    original = sup.recover

    def recover() -> Tuple[bool, str]:
        seen_lock.append(run_lock.read_state(sup.cfg.lock_path, cluster.now).holder.token)
        return original()

    sup.recover = recover  # type: ignore[method-assign]
    decision = sup.poll()
    assert decision.action == sh.ACTION_RECOVER
    assert cluster.commands == [("spark1", "stop", "glm53-rank0"), ("spark2", "stop", "glm53-rank1"),
                                ("spark2", "start", "glm53-rank1"), ("spark1", "start", "glm53-rank0")]
    assert seen_lock == [sup.cfg.lock_token] and not run_lock.read_state(sup.cfg.lock_path, cluster.now).held
    state = sh.load_state(sup.cfg.state_path)
    assert (state.phase, state.attempts) == (sh.PHASE_WATCHING, 1)
    assert state.recoveries[-1]["ok"] and state.recoveries[-1]["detail"] == "serving; canary: Paris."
    assert state.recoveries[-1]["trigger"] == "rank 1 on node spark2: container glm53-rank1 exited (exit code 137)"


def test_a_crash_loop_backs_off_then_gives_up_and_leaves_the_group_stopped(cluster: FakeCluster,
                                                                           tmp_path: Path) -> None:
    sup, lines = supervisor(cluster, tmp_path, backoff_s=30, backoff_max_s=600, max_attempts=3)
    cluster.status["glm53-rank0"] = ("exited", 1)
    cluster.start_outcome["glm53-rank0"] = ("exited", 1)  # the head dies at once on every start
    starts: List[float] = []
    actions = []
    while len(actions) < 200:
        before = len(cluster.commands)
        decision = sup.poll()
        actions.append(decision.action)
        starts += [cluster.now for _n, verb, name in cluster.commands[before:]
                   if (verb, name) == ("start", "glm53-rank0")]
        if decision.action == sh.ACTION_GIVE_UP:
            break
        if decision.action == sh.ACTION_NONE:
            cluster.sleep(10)
    assert actions.count(sh.ACTION_RECOVER) == 3 and actions[-1] == sh.ACTION_GIVE_UP
    # Back-off between the recoveries: 30 s, then 60 s (to the 10 s poll).
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert 30 <= gaps[0] < 45 and 60 <= gaps[1] < 75, gaps
    state = sh.load_state(sup.cfg.state_path)
    assert state.phase == sh.PHASE_GIVEN_UP and "gave up after 3 recoveries" in state.reason
    assert "rank 0 on node spark1 (container glm53-rank0) failed: container exited (exit code 1)" in state.reason
    assert "failed to load the checkpoint" in state.reason
    assert all(status != "running" for status, _c in cluster.status.values())
    # Given up is final: nothing more happens, the file is left to the playbooks.
    count, mtime = len(cluster.commands), Path(sup.cfg.state_path).stat().st_mtime_ns
    cluster.status = {name: ("exited", 0) for name in cluster.status}
    assert sup.poll().action == sh.ACTION_NONE and len(cluster.commands) == count
    assert Path(sup.cfg.state_path).stat().st_mtime_ns == mtime
    assert any("recovery FAILED" in line for line in lines)


def test_a_site_run_holding_the_lock_is_never_raced(cluster: FakeCluster, tmp_path: Path) -> None:
    sup, _lines = supervisor(cluster, tmp_path)
    run_lock.try_acquire(sup.cfg.lock_path, run_lock.Holder(token="site", owner="alice@ctl", playbook="Deploy"),
                         cluster.now)
    cluster.status["glm53-rank1"] = ("exited", 137)
    assert sup.poll().state.phase == sh.PHASE_PAUSED and cluster.commands == []
    cluster.sleep(10)
    sup.poll()
    assert len([line for line in _lines if line.startswith("paused")]) == 1, "the log repeats a ticking reason"
    # The run owns the state file meanwhile (it resets it at its end): the supervisor does not write it.
    assert not Path(sup.cfg.state_path).exists()


def test_a_lock_left_by_a_killed_supervisor_is_taken_back_at_start(cluster: FakeCluster, tmp_path: Path) -> None:
    sup, _lines = supervisor(cluster, tmp_path)
    run_lock.try_acquire(sup.cfg.lock_path, run_lock.Holder(token=sup.cfg.lock_token, owner="x"), cluster.now)
    sup.run(polls=1)
    assert not run_lock.read_state(sup.cfg.lock_path, cluster.now).held


def test_the_lock_a_recovery_takes_records_the_boot_and_the_container(cluster: FakeCluster, tmp_path: Path) -> None:
    # What a site.yml run needs to tell this holder is gone: the head's boot id and the supervisor's container.
    sup, _lines = supervisor(cluster, tmp_path)
    sup.cfg = sh.SupervisorConfig.from_dict(dict(
        url=sup.cfg.url, served_model_name="m", state_path=sup.cfg.state_path, lock_path=sup.cfg.lock_path,
        lock_token=sup.cfg.lock_token, container="glm53-self-heal", policy={"poll_s": 10, "ready_timeout_s": 60},
        ranks=[{"rank": 0, "node": "spark1", "container": "glm53-rank0", "ssh": None},
               {"rank": 1, "node": "spark2", "container": "glm53-rank1", "ssh": "root@10.0.0.2"}]))
    sup.boot_id = lambda: "boot-1"
    cluster.status["glm53-rank1"] = ("exited", 137)
    seen: List[Optional[run_lock.Holder]] = []
    original = sup.recover

    def recover() -> Tuple[bool, str]:
        seen.append(run_lock.read_state(sup.cfg.lock_path, cluster.now).holder)
        return original()

    sup.recover = recover  # type: ignore[method-assign]
    assert sup.poll().action == sh.ACTION_RECOVER
    assert [(h.token, h.boot_id, h.container) for h in seen if h] == [("glm53-self-heal", "boot-1", "glm53-self-heal")]


def test_an_unreachable_worker_is_waited_for_then_the_group_recovers(cluster: FakeCluster, tmp_path: Path) -> None:
    sup, _lines = supervisor(cluster, tmp_path)
    cluster.reachable = False
    cluster.status = {"glm53-rank0": ("exited", 0), "glm53-rank1": ("exited", 0)}  # both nodes rebooted
    for _poll in range(5):
        decision = sup.poll()
        assert decision.action == sh.ACTION_NONE and decision.state.phase == sh.PHASE_WAITING
    assert cluster.commands == []
    cluster.reachable = True
    assert sup.poll().action == sh.ACTION_RECOVER
    assert sh.load_state(sup.cfg.state_path).phase == sh.PHASE_WATCHING
    assert all(status == "running" for status, _c in cluster.status.values())


def test_a_stopped_state_written_by_stop_yml_is_obeyed(cluster: FakeCluster, tmp_path: Path) -> None:
    sup, _lines = supervisor(cluster, tmp_path)
    Path(sup.cfg.state_path).parent.mkdir(parents=True)
    Path(sup.cfg.state_path).write_text(json.dumps({"phase": "stopped", "reason": "stopped by playbooks/stop.yml"}))
    cluster.status = {"glm53-rank0": ("exited", 0), "glm53-rank1": ("exited", 0)}
    assert sup.poll().action == sh.ACTION_NONE and cluster.commands == []


def test_http_client_talks_to_a_real_server_without_ansible() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            code = 200 if self.path == "/health" else 404
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"ok" if code == 200 else b"no")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = "http://127.0.0.1:%d" % server.server_address[1]
    try:
        assert sh.http_client("GET", base + "/health", {}, None, 5) == HttpResult(200, "ok")
        assert sh.http_client("GET", base + "/v1/x?y=1", {}, None, 5).status == 404
    finally:
        server.shutdown()
        server.server_close()
    refused = sh.http_client("GET", base + "/health", {}, None, 5)
    assert refused.status == 0 and "ConnectionRefusedError" in refused.error


# --------------------------------------------------------------------------- memory before a restart (GB10)

GIB = 1 << 30
DROP = ("sudo", "-n", "/usr/local/sbin/glm53-drop-caches")
# roles/glm53/vars/main.yml's request on a GB10 rank: 0.85 of 121 GiB asks for 102.9 GiB, 4 GiB kept for the OS.
GB10_REQUEST = {"gpu": "True", "gpu_memory_utilization": "0.85", "kv_cache_memory_bytes": "0",
                "max_model_len": "200000", "weights_bytes": str(82 * GIB), "overhead_bytes": str(5 * GIB),
                "kv_bytes_per_token": "17014", "reserve_bytes": str(4 * GIB)}
# The simulation's: a CPU node judged by MemAvailable alone (glm53_gpu false, utilization 0.2).
SIM_REQUEST = {"gpu": False, "gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": 0, "max_model_len": 1024,
               "weights_bytes": 3_000_000, "overhead_bytes": 0, "kv_bytes_per_token": 0, "reserve_bytes": 0}


class GB10Cluster(FakeCluster):
    """FakeCluster whose nodes also answer `cat /proc/meminfo` and the drop script. Each node is a GB10 after a
    crash: 121 GiB, MemAvailable 110 GiB of which 82 GiB is the checkpoint's clean page cache (1 GiB of it
    mapped, so it stays). A drop empties the cache down to the mapped pages, unless the node refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = {node: {"total": 121 * GIB, "available": 110 * GIB, "cache": 82 * GIB, "mapped": 1 * GIB}
                       for node in ("spark1", "spark2")}
        self.refuse: Dict[str, Tuple[int, str]] = {}

    def meminfo(self, node: str) -> str:
        mem = self.memory[node]
        kib = {"MemTotal": mem["total"], "MemFree": max(0, mem["available"] - mem["cache"]), "MemAvailable": mem["available"],
               "Active(file)": mem["cache"] // 2, "Inactive(file)": mem["cache"] - mem["cache"] // 2,
               "Mapped": mem["mapped"]}
        return "".join("%s: %d kB\n" % (name, value // 1024) for name, value in kib.items())

    def run(self, argv: Sequence[str], timeout: float, merge: bool) -> Tuple[int, str, str]:
        node, command = "spark1", list(argv)
        if argv[0] == "ssh":
            if not self.reachable:
                return 255, "", "ssh: connect to host 10.0.0.2 port 22: No route to host"
            node, command = "spark2", shlex.split(argv[-1])
        if command == ["cat", "/proc/meminfo"]:
            return 0, self.meminfo(node), ""
        if tuple(command) == DROP:
            self.commands.append((node, "drop", "page cache"))
            if node in self.refuse:
                rc, err = self.refuse[node]
                return rc, "", err
            self.memory[node]["cache"] = self.memory[node]["mapped"]
            return 0, "", ""
        return super().run(argv, timeout, merge)


def memory_supervisor(cluster: GB10Cluster, tmp_path: Path, request: Dict[str, object], drop: bool = True,
                      refused: str = "", **policy: float) -> Tuple[sh.Supervisor, List[str]]:
    sup, lines = supervisor(cluster, tmp_path, **policy)
    sup.cfg.memory = sh.MemoryConfig.from_dict({"drop_page_cache": drop, "nodes": {
        node: {"request": request, "drop": [] if refused else list(DROP), "drop_refused": refused}
        for node in ("spark1", "spark2")}})
    return sup, lines


def test_a_recovery_drops_every_nodes_page_cache_before_any_rank_starts(tmp_path: Path) -> None:
    cluster = GB10Cluster()
    sup, lines = memory_supervisor(cluster, tmp_path, GB10_REQUEST)
    cluster.status["glm53-rank1"] = ("exited", 137)
    assert sup.poll().action == sh.ACTION_RECOVER
    # Stopped, then dropped on both nodes (the worker through ssh), and only then started.
    assert cluster.commands == [("spark1", "stop", "glm53-rank0"), ("spark2", "stop", "glm53-rank1"),
                                ("spark1", "drop", "page cache"), ("spark2", "drop", "page cache"),
                                ("spark2", "start", "glm53-rank1"), ("spark1", "start", "glm53-rank0")]
    last = sh.load_state(sup.cfg.state_path).recoveries[-1]
    assert last["ok"] and [(m["node"], m["drop"], m["problems"]) for m in last["memory"]] == [
        ("spark1", "dropped", []), ("spark2", "dropped", [])]
    assert "page cache dropped: 82.0 GiB -> 1.0 GiB; CUDA-usable 28.0 GiB -> 109.0 GiB" in last["memory"][1]["summary"]
    assert any(line.startswith("memory: spark2: 109.0 GiB CUDA-usable now") for line in lines)


def test_a_refused_drop_is_recorded_as_skipped_and_a_budget_that_still_fits_recovers(tmp_path: Path) -> None:
    # The simulation's case: its nodes' /proc/sys is read-only, and a CPU node's cache counts as available.
    cluster = GB10Cluster()
    cluster.refuse["spark2"] = (2, "/usr/local/sbin/glm53-drop-caches: 4: cannot create /proc/sys/vm/drop_caches: "
                                   "Read-only file system")
    sup, _lines = memory_supervisor(cluster, tmp_path, SIM_REQUEST)
    cluster.status["glm53-rank1"] = ("exited", 137)
    assert sup.poll().action == sh.ACTION_RECOVER
    state = sh.load_state(sup.cfg.state_path)
    assert state.phase == sh.PHASE_WATCHING and state.recoveries[-1]["ok"]
    worker = state.recoveries[-1]["memory"][1]
    assert worker["drop"] == "skipped" and "Read-only file system" in worker["drop_reason"]
    assert "re-run site.yml with become working on spark2, or set glm53_drop_page_cache=false" in worker["drop_reason"]
    assert "page cache NOT dropped before it on spark2" in sh.summary(state)
    assert ("spark2", "start", "glm53-rank1") in cluster.commands


def test_a_refused_drop_on_a_gb10_starts_nothing_and_says_which_node_and_why(tmp_path: Path) -> None:
    cluster = GB10Cluster()
    cluster.refuse["spark2"] = (1, "sudo: a password is required")
    sup, _lines = memory_supervisor(cluster, tmp_path, GB10_REQUEST)
    cluster.status["glm53-rank1"] = ("exited", 137)
    sup.poll()
    assert not [c for c in cluster.commands if c[1] == "start"]
    last = sh.load_state(sup.cfg.state_path).recoveries[-1]
    assert not last["ok"]
    assert last["detail"].startswith(
        "not starting the ranks, the memory settings do not fit: on node spark2, glm53_gpu_memory_utilization=0.85 "
        "asks for 102.9 GiB of 121.0 GiB, but this node has 28.0 GiB that CUDA can take")
    assert "(page cache not dropped: `sudo -n /usr/local/sbin/glm53-drop-caches` failed (exit 1: sudo: a password " \
           "is required)" in last["detail"]
    assert "Fix: free memory on spark2" in last["detail"] and "spark1," not in last["detail"]


def test_memory_that_never_fits_backs_off_then_gives_up_with_node_sizes_and_fix(tmp_path: Path) -> None:
    cluster = GB10Cluster()
    # Another program holds 50 GiB on the head: even with its cache dropped, 59 GiB is what CUDA can take.
    cluster.memory["spark1"].update(available=60 * GIB, cache=40 * GIB)
    sup, _lines = memory_supervisor(cluster, tmp_path, GB10_REQUEST, backoff_s=30, max_attempts=3)
    cluster.status["glm53-rank0"] = ("exited", 137)
    actions = []
    while sh.ACTION_GIVE_UP not in actions and len(actions) < 100:
        actions.append(sup.poll().action)
        cluster.sleep(10)
    assert actions.count(sh.ACTION_RECOVER) == 3 and actions[-1] == sh.ACTION_GIVE_UP
    assert not [c for c in cluster.commands if c[1] == "start"], "no rank may start on memory that does not fit"
    state = sh.load_state(sup.cfg.state_path)
    assert state.phase == sh.PHASE_GIVEN_UP
    assert "gave up after 3 recoveries in a row" in state.reason
    assert ("last recovery: not starting the ranks, the memory settings do not fit: on node spark1, "
            "glm53_gpu_memory_utilization=0.85 asks for 102.9 GiB of 121.0 GiB, but this node has 59.0 GiB that CUDA "
            "can take") in state.reason
    assert "at most 0.45 fits" in state.reason and "Fix: free memory on spark1" in state.reason


def test_without_glm53_drop_page_cache_nothing_is_dropped_and_the_cache_counts_against_cuda(tmp_path: Path) -> None:
    cluster = GB10Cluster()
    sup, _lines = memory_supervisor(cluster, tmp_path, GB10_REQUEST, drop=False)
    cluster.status["glm53-rank1"] = ("exited", 137)
    sup.poll()
    assert not [c for c in cluster.commands if c[1] in ("drop", "start")]
    memory = sh.load_state(sup.cfg.state_path).recoveries[-1]["memory"]
    assert [m["drop"] for m in memory] == ["not asked", "not asked"] and all(m["problems"] for m in memory)


def test_a_drop_install_could_not_grant_is_skipped_with_installs_reason(tmp_path: Path) -> None:
    cluster = GB10Cluster()
    sup, _lines = memory_supervisor(cluster, tmp_path, SIM_REQUEST, refused="become failed (sudo: a password is "
                                                                            "required) when site.yml installed it")
    cluster.status["glm53-rank1"] = ("exited", 137)
    sup.poll()
    assert not [c for c in cluster.commands if c[1] == "drop"]
    memory = sh.load_state(sup.cfg.state_path).recoveries[-1]["memory"]
    assert memory[0]["drop"] == "skipped" and memory[0]["drop_reason"].startswith("become failed")


def test_a_node_whose_memory_cannot_be_read_starts_nothing(tmp_path: Path) -> None:
    cluster = GB10Cluster()
    sup, _lines = memory_supervisor(cluster, tmp_path, SIM_REQUEST)
    cluster.status["glm53-rank1"] = ("exited", 137)
    cluster.meminfo = lambda node: "MemTotal: 1 kB\n"  # type: ignore[method-assign]
    sup.poll()
    last = sh.load_state(sup.cfg.state_path).recoveries[-1]
    assert not last["ok"] and last["detail"].startswith("not starting the ranks: node spark1: /proc/meminfo lacks")
    assert not [c for c in cluster.commands if c[1] == "start"]


def test_the_memory_section_of_the_config_install_yml_writes() -> None:
    base = {"url": "http://127.0.0.1:8888", "served_model_name": "m", "state_path": "/s", "lock_path": "/l",
            "lock_token": "t", "ranks": [{"rank": 0, "node": "spark1", "container": "glm53-rank0"},
                                         {"rank": 1, "node": "spark2", "container": "glm53-rank1", "ssh": "s@h"}]}
    assert sh.SupervisorConfig.from_dict(base).memory is None  # a config from before the memory step
    nodes = {"spark1": {"request": GB10_REQUEST, "drop": ["/usr/local/sbin/glm53-drop-caches"]},
             "spark2": {"request": GB10_REQUEST, "drop": [], "drop_refused": "become failed"}}
    config = sh.SupervisorConfig.from_dict(dict(base, memory={"drop_page_cache": "True", "nodes": nodes}))
    assert config.memory is not None and config.memory.drop_page_cache
    head = config.memory.nodes["spark1"]
    assert head.drop_argv == ("/usr/local/sbin/glm53-drop-caches",) and head.request.gpu is True
    assert (head.request.gpu_memory_utilization, head.request.weights_bytes) == (0.85, 82 * GIB)
    assert config.memory.nodes["spark2"].drop_refused == "become failed"
    assert not sh.MemoryConfig.from_dict({"drop_page_cache": "false", "nodes": {}}).drop_page_cache
    with pytest.raises(ValueError, match="no memory budget for node.s. spark2: re-run site.yml"):
        sh.SupervisorConfig.from_dict(dict(base, memory={"drop_page_cache": True,
                                                         "nodes": {"spark1": nodes["spark1"]}}))


def test_the_supervisor_says_at_start_what_it_does_about_memory() -> None:
    assert "no memory check" in sh.memory_plan(None)
    request = sh.budget_request(SIM_REQUEST)
    off = sh.MemoryConfig(False, {"spark1": sh.NodeMemory(request)})
    assert sh.memory_plan(off).endswith("no page-cache drop (glm53_drop_page_cache false)")
    on = sh.MemoryConfig(True, {"spark1": sh.NodeMemory(request, DROP),
                                "spark2": sh.NodeMemory(request, (), "become failed")})
    assert sh.memory_plan(on) == ("before a restart: page cache dropped (spark1: `sudo -n /usr/local/sbin/glm53-drop-"
                                  "caches`; spark2: SKIPPED (become failed)), then every node's memory judged with "
                                  "the start budget")


# --------------------------------------------------------------------------- the GID re-check, scripted

# What the fabric stage chose, as install.yml writes it: both PCIe twins of each Spark's CX7 port, GID index 3.
FABRIC = {
    "spark1": {"gid_index": 3, "rails": [
        {"hca": "rocep1s0f1", "port": 1, "netdev": "enp1s0f1np1", "address": "10.0.0.1"},
        {"hca": "roceP2p1s0f1", "port": 1, "netdev": "enP2p1s0f1np1", "address": "192.168.101.1"}]},
    "spark2": {"gid_index": 3, "rails": [
        {"hca": "rocep1s0f1", "port": 1, "netdev": "enp1s0f1np1", "address": "10.0.0.2"},
        {"hca": "roceP2p1s0f1", "port": 1, "netdev": "enP2p1s0f1np1", "address": "192.168.101.2"}]},
}
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def mapped_gid(address: str) -> str:
    """The kernel's text for the IPv4-mapped GID of an address, as in /sys/class/infiniband/*/ports/*/gids/N."""
    return ipaddress.IPv6Address("::ffff:" + address).exploded


def gid_slot(hca: str, index: int, gid: str, gid_type: str, ndev: str) -> Dict[str, str]:
    base = "/sys/class/infiniband/%s/ports/1" % hca
    return {"%s/gids/%d" % (base, index): gid, "%s/gid_attrs/types/%d" % (base, index): gid_type,
            "%s/gid_attrs/ndevs/%d" % (base, index): ndev}


class RoceCluster(FakeCluster):
    """FakeCluster whose nodes also have a GID table in sysfs, answered to `grep -Hs . FILE...` as GNU grep does:
    PATH:VALUE per readable file, exit 2 when some file is missing. Every rail's RoCE v2 GID sits at index 3
    (link-local IPv6 at 0 and 1, RoCE v1 of the address at 2), as the fabric stage found it."""

    def __init__(self) -> None:
        super().__init__()
        self.sysfs: Dict[str, Dict[str, str]] = {}
        for node, spec in FABRIC.items():
            self.sysfs[node] = {}
            for rail in spec["rails"]:
                gid = mapped_gid(rail["address"])
                for index, (text, kind) in enumerate([("fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1"),
                                                      ("fe80:0000:0000:0000:0000:0000:0000:0001", "RoCE v2"),
                                                      (gid, "IB/RoCE v1"), (gid, "RoCE v2")]):
                    self.sysfs[node].update(gid_slot(rail["hca"], index, text, kind, rail["netdev"]))
        self.reads: List[str] = []
        self.read_fails: Dict[str, Tuple[int, str, str]] = {}

    def run(self, argv: Sequence[str], timeout: float, merge: bool) -> Tuple[int, str, str]:
        node, command = "spark1", list(argv)
        if argv[0] == "ssh" and self.reachable:
            node, command = "spark2", shlex.split(argv[-1])
        if command[:3] == ["grep", "-Hs", "."]:
            self.reads.append(node)
            self.commands.append((node, "read", "gids"))
            if node in self.read_fails:
                return self.read_fails[node]
            present = [path for path in command[3:] if path in self.sysfs[node]]
            out = "".join("%s:%s\n" % (path, self.sysfs[node][path]) for path in present)
            return (2 if len(present) < len(command[3:]) else 0 if out else 1), out, ""
        return super().run(argv, timeout, merge)

    def move_index(self, node: str, hca: str) -> None:
        """A reboot re-added the addresses in another order: index 3 now holds the link-local GID, the
        address's RoCE v2 GID moved to 5."""
        rail = next(r for r in FABRIC[node]["rails"] if r["hca"] == hca)
        self.sysfs[node].update(gid_slot(hca, 3, "fe80:0000:0000:0000:0000:0000:0000:0002", "RoCE v2", rail["netdev"]))
        self.sysfs[node].update(gid_slot(hca, 5, mapped_gid(rail["address"]), "RoCE v2", rail["netdev"]))


def roce_supervisor(cluster: RoceCluster, tmp_path: Path, fabric: Optional[Dict[str, object]] = None,
                    **policy: float) -> Tuple[sh.Supervisor, List[str]]:
    sup, lines = supervisor(cluster, tmp_path, **policy)
    nodes = FABRIC if fabric is None else fabric
    sup.cfg.fabric = {node: sh.NodeFabric.from_dict(spec) for node, spec in nodes.items()}
    return sup, lines


def test_a_gid_index_still_right_is_read_on_every_node_before_any_start_and_the_group_recovers(
        tmp_path: Path) -> None:
    cluster = RoceCluster()
    sup, lines = roce_supervisor(cluster, tmp_path)
    cluster.status["glm53-rank1"] = ("exited", 137)
    assert sup.poll().action == sh.ACTION_RECOVER
    # Stopped, then read on both nodes (the worker through ssh), and only then started.
    assert cluster.commands == [("spark1", "stop", "glm53-rank0"), ("spark2", "stop", "glm53-rank1"),
                                ("spark1", "read", "gids"), ("spark2", "read", "gids"),
                                ("spark2", "start", "glm53-rank1"), ("spark1", "start", "glm53-rank0")]
    state = sh.load_state(sup.cfg.state_path)
    assert state.phase == sh.PHASE_WATCHING and state.recoveries[-1]["ok"]
    assert state.recoveries[-1]["fabric"] == [{"node": "spark1", "gid_index": 3, "problems": []},
                                              {"node": "spark2", "gid_index": 3, "problems": []}]
    assert "fabric: node spark2: GID index 3 unchanged on rocep1s0f1:1, roceP2p1s0f1:1" in lines


@pytest.mark.parametrize("change,holds", [
    ("moved", "holds fe80:0000:0000:0000:0000:0000:0000:0002, not 0000:0000:0000:0000:0000:ffff:c0a8:6502 "
              "(192.168.101.2)"),
    ("emptied", "is empty (an empty GID kills the rank with ibv_modify_qp errno 61)"),
    ("v1", "is IB/RoCE v1, not RoCE v2"),
    ("gone", "does not exist (no /sys/class/infiniband/roceP2p1s0f1/ports/1/gids/3)"),
])
def test_a_changed_gid_slot_starts_nothing_and_gives_up_at_once_naming_node_port_index_and_fix(
        tmp_path: Path, change: str, holds: str) -> None:
    cluster = RoceCluster()
    hca, slot = "roceP2p1s0f1", "/sys/class/infiniband/roceP2p1s0f1/ports/1/%s/3"
    if change == "moved":
        cluster.move_index("spark2", hca)
    elif change == "emptied":
        cluster.sysfs["spark2"][slot % "gids"] = ZERO_GID
        del cluster.sysfs["spark2"][slot % "gid_attrs/types"]  # an empty slot's type reads EINVAL
    elif change == "v1":
        cluster.sysfs["spark2"][slot % "gid_attrs/types"] = "IB/RoCE v1"
    else:
        for kind in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
            del cluster.sysfs["spark2"][slot % kind]
    sup, _lines = roce_supervisor(cluster, tmp_path, max_attempts=3)
    cluster.status["glm53-rank0"] = ("exited", 137)
    assert sup.poll().action == sh.ACTION_RECOVER
    assert not [c for c in cluster.commands if c[1] == "start"], "no rank may start on a stale GID index"
    state = sh.load_state(sup.cfg.state_path)
    # Given up after one attempt, not backed off: no retry moves the index back.
    assert (state.phase, state.attempts) == (sh.PHASE_GIVEN_UP, 1)
    assert ("node spark2: roceP2p1s0f1 port 1 GID index 3 %s" % holds) in state.reason
    assert "0000:0000:0000:0000:0000:ffff:c0a8:6502 (192.168.101.2" in state.reason
    assert "spark1" not in state.reason.split("Fix:")[0].split("stale")[1], "the head's slots are right"
    assert "Fix: re-run site.yml: the fabric stage re-discovers the GID index" in state.reason
    assert state.reason.startswith("gave up at recovery 1 without retrying: not starting the ranks")
    last = state.recoveries[-1]
    assert not last["ok"] and last["fabric"][1]["node"] == "spark2" and len(last["fabric"][1]["problems"]) == 1
    assert "memory" not in last
    # Given up is final: later polls read nothing and start nothing.
    count = len(cluster.commands)
    cluster.sleep(3600)
    assert sup.poll().action == sh.ACTION_NONE and len(cluster.commands) == count


def test_a_node_whose_gid_table_cannot_be_read_backs_off_instead_of_giving_up(tmp_path: Path) -> None:
    cluster = RoceCluster()
    cluster.read_fails["spark2"] = (255, "", "ssh: connect to host 10.0.0.2 port 22: Connection timed out")
    sup, _lines = roce_supervisor(cluster, tmp_path)
    cluster.status["glm53-rank1"] = ("exited", 137)
    sup.poll()
    state = sh.load_state(sup.cfg.state_path)
    assert state.phase == sh.PHASE_BACKOFF and not [c for c in cluster.commands if c[1] == "start"]
    assert state.recoveries[-1]["detail"] == ("not starting the ranks: cannot read the GID table on node spark2 "
                                              "(exit 255): ssh: connect to host 10.0.0.2 port 22: Connection timed out")
    # Once it answers, the next recovery (after the back-off) goes through.
    del cluster.read_fails["spark2"]
    cluster.sleep(60)
    assert sup.poll().action == sh.ACTION_RECOVER
    assert sh.load_state(sup.cfg.state_path).phase == sh.PHASE_WATCHING


def test_without_rdma_no_gid_table_is_read(tmp_path: Path) -> None:
    cluster = RoceCluster()
    for node in cluster.sysfs:  # whatever sysfs holds is not looked at
        cluster.sysfs[node] = {}
    sup, lines = roce_supervisor(cluster, tmp_path, fabric={})
    cluster.status["glm53-rank1"] = ("exited", 137)
    assert sup.poll().action == sh.ACTION_RECOVER
    assert cluster.reads == [] and not any(line.startswith("fabric:") for line in lines)
    last = sh.load_state(sup.cfg.state_path).recoveries[-1]
    assert last["ok"] and "fabric" not in last


def test_the_fabric_section_of_the_config_install_yml_writes() -> None:
    base = {"url": "http://127.0.0.1:8888", "served_model_name": "m", "state_path": "/s", "lock_path": "/l",
            "lock_token": "t", "ranks": [{"rank": 0, "node": "spark1", "container": "glm53-rank0"},
                                         {"rank": 1, "node": "spark2", "container": "glm53-rank1", "ssh": "s@h"}]}
    # A config from before the re-check, and one with RDMA off, re-check nothing.
    assert sh.SupervisorConfig.from_dict(base).fabric == {}
    assert sh.SupervisorConfig.from_dict(dict(base, fabric={"nodes": {}})).fabric == {}
    # Ansible renders numbers from set_fact as strings.
    worker = {"gid_index": "3", "rails": [{"hca": "rocep1s0f1", "port": "1", "netdev": "enp1s0f1np1",
                                           "address": "10.0.0.2"}]}
    config = sh.SupervisorConfig.from_dict(dict(base, fabric={"nodes": {"spark1": FABRIC["spark1"],
                                                                        "spark2": worker}}))
    assert config.fabric["spark2"] == sh.NodeFabric(3, (sh.FabricRail("rocep1s0f1", 1, "enp1s0f1np1",
                                                                      ipaddress.IPv4Address("10.0.0.2")),))
    assert config.fabric["spark1"].read_argv() == [
        "grep", "-Hs", ".", "/sys/class/infiniband/rocep1s0f1/ports/1/gids/3",
        "/sys/class/infiniband/rocep1s0f1/ports/1/gid_attrs/types/3",
        "/sys/class/infiniband/rocep1s0f1/ports/1/gid_attrs/ndevs/3",
        "/sys/class/infiniband/roceP2p1s0f1/ports/1/gids/3",
        "/sys/class/infiniband/roceP2p1s0f1/ports/1/gid_attrs/types/3",
        "/sys/class/infiniband/roceP2p1s0f1/ports/1/gid_attrs/ndevs/3"]
    with pytest.raises(ValueError, match=r"no fabric \(GID index\) for node.s. spark2: re-run site.yml"):
        sh.SupervisorConfig.from_dict(dict(base, fabric={"nodes": {"spark1": FABRIC["spark1"]}}))
    assert "no GID re-check" in sh.fabric_plan({})
    assert sh.fabric_plan(config.fabric) == (
        "before a restart: the GID index of every rail re-checked (spark1: index 3 on rocep1s0f1:1, roceP2p1s0f1:1; "
        "spark2: index 3 on rocep1s0f1:1)")
