# SPDX-License-Identifier: MIT
"""vllm_health: decision logic, the waiting loop with scripted I/O, and the loop for real against a
stdlib HTTP stand-in for vLLM plus a fake ``docker`` executable on PATH."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from ansible_collections.sparkops.glm53.plugins.module_utils import health as h

REPO = Path(__file__).resolve().parents[4]
HEAD = h.Rank(0, "spark1", "glm53-rank0")
WORKER = h.Rank(1, "spark2", "glm53-rank1", "root@10.0.0.2")
MODEL = "GLM-5.3-Flash-EXL3"


def chat_body(content: Optional[str], finish: str = "stop") -> str:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                    "finish_reason": finish}], "usage": {"completion_tokens": 7}})


def models_body(*names: str) -> str:
    return json.dumps({"object": "list", "data": [{"id": n, "object": "model"} for n in names]})


# --------------------------------------------------------------------------- pure decisions


@pytest.mark.parametrize(
    "rc,out,err,ssh,status,code",
    [
        (0, "running 0\n", "", False, "running", 0),
        (0, "exited 137\n", "", False, "exited", 137),
        (0, "restarting 1", "", False, "restarting", 1),
        (1, "", "Error: No such object: glm53-rank1", False, "missing", None),
        (1, "", "Error response from daemon: No such container: x", True, "missing", None),
        (255, "", "ssh: connect to host 10.0.0.2 port 22: No route to host", True, "unreachable", None),
        (255, "", "boom", False, "unknown", None),
        (0, "  ", "", False, "unknown", None),
    ],
)
def test_parse_inspect(rc: int, out: str, err: str, ssh: bool, status: str, code: Optional[int]) -> None:
    state = h.parse_inspect(rc, out, err, via_ssh=ssh)
    assert (state.status, state.exit_code) == (status, code)


def test_inspect_and_logs_argv_local_and_over_ssh() -> None:
    assert h.docker_inspect_argv(HEAD) == ["docker", "inspect", "-f", h.INSPECT_FORMAT, "glm53-rank0"]
    argv = h.docker_inspect_argv(WORKER)
    assert argv[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    assert argv[5] == "root@10.0.0.2"
    # the Go template has spaces and braces: it must reach the remote shell as one quoted word
    assert argv[6] == "docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.State.FinishedAt}}' glm53-rank1"
    assert h.docker_logs_argv(WORKER, 40)[-1] == "docker logs --tail 40 glm53-rank1 2>&1"
    assert h.docker_logs_argv(HEAD, 5) == ["docker", "logs", "--tail", "5", "glm53-rank0"]


def test_parse_inspect_keeps_the_exit_time_only_when_there_is_one() -> None:
    dead = h.parse_inspect(0, "exited 137 2026-11-30T19:01:02.5Z\n", "")
    assert dead.finished_at == "2026-11-30T19:01:02.5Z"
    assert h.parse_inspect(0, "running 0 0001-01-01T00:00:00Z\n", "").finished_at is None
    assert h.parse_inspect(0, "exited 1 garbage\n", "").finished_at is None


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2026-11-30T19:01:02Z", 1796065262.0),
        ("2026-11-30T19:01:02.5Z", 1796065262.5),
        ("2026-11-30T19:01:02.123456789Z", 1796065262.123456789),
        ("2026-11-30T20:01:02.25+01:00", 1796065262.25),
        ("0001-01-01T00:00:00Z", None),
        ("", None),
        ("yesterday", None),
    ],
)
def test_docker_time(text: str, expected: Optional[float]) -> None:
    got = h.docker_time(text)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_death_order_puts_the_first_exit_first_even_when_nanoseconds_are_trimmed() -> None:
    # Compared as text, ".12Z" would sort before ".1Z"; as times .1 s comes first.
    early = h.ContainerState("exited", 137, finished_at="2026-11-30T19:01:02.1Z")
    late = h.ContainerState("exited", 1, finished_at="2026-11-30T19:01:02.12Z")
    unknown = h.ContainerState("missing")
    ranks = sorted([(HEAD, late), (WORKER, early), (h.Rank(2, "s3", "c"), unknown)],
                   key=lambda item: h.death_order(*item))
    assert [r.rank for r, _s in ranks] == [1, 0, 2]


def test_rank_from_dict_treats_empty_ssh_as_local() -> None:
    assert h.Rank.from_dict({"rank": "1", "node": "s2", "container": "c", "ssh": ""}) == h.Rank(1, "s2", "c", None)


def test_rank_watch_exited_fails_at_once() -> None:
    watch = h.RankWatch(3)
    verdict = watch.observe(WORKER, h.ContainerState("exited", 137))
    assert verdict.failed and "exit code 137" in verdict.reason


def test_rank_watch_needs_consecutive_misses() -> None:
    watch = h.RankWatch(3)
    missing = h.ContainerState("missing")
    running = h.ContainerState("running", 0)
    assert not watch.observe(WORKER, missing).failed
    assert not watch.observe(WORKER, missing).failed
    assert not watch.observe(WORKER, running).failed  # a running poll resets the count
    assert not watch.observe(WORKER, missing).failed
    assert not watch.observe(HEAD, missing).failed  # counted per rank
    assert not watch.observe(WORKER, missing).failed
    verdict = watch.observe(WORKER, missing)
    assert verdict.failed and "3 consecutive polls" in verdict.reason


def test_rank_watch_rejects_zero_threshold() -> None:
    with pytest.raises(ValueError):
        h.RankWatch(0)


def test_check_models() -> None:
    ok = h.check_models(200, models_body(MODEL, "draft"), MODEL)
    assert ok.ready and not ok.fatal and ok.models == [MODEL, "draft"]
    wrong = h.check_models(200, models_body("other"), MODEL)
    assert wrong.fatal and "other" in wrong.reason
    assert h.check_models(401, "", MODEL).fatal
    starting = h.check_models(503, "", MODEL)
    assert not starting.ready and not starting.fatal
    assert not h.check_models(200, "<html>", MODEL).ready


def test_canary_request_puts_thinking_switch_at_top_level() -> None:
    body = h.canary_request(h.Canary.from_dict({"prompt": "hi", "max_tokens": 5}), MODEL)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["temperature"] == 0 and body["max_tokens"] == 5 and body["model"] == MODEL
    assert "extra_body" not in body


@pytest.mark.parametrize(
    "status,body,regex,ok,reason",
    [
        (200, chat_body("Paris is the capital."), None, True, ""),
        (200, chat_body("Paris is the capital."), r"Paris", True, ""),
        (200, chat_body("Lyon"), r"Paris", False, "does not match"),
        (200, chat_body(""), None, False, "empty"),
        (200, chat_body(None), None, False, "empty"),
        (200, chat_body("!!!!!!!!!!!!"), None, False, "degenerate"),
        (500, '{"error": "EngineDeadError"}', None, False, "HTTP 500"),
        (200, "not json", None, False, "not a chat completion"),
        (200, '{"choices": []}', None, False, "not a chat completion"),
    ],
)
def test_evaluate_canary(status: int, body: str, regex: Optional[str], ok: bool, reason: str) -> None:
    result = h.evaluate_canary(status, body, regex)
    assert result.ok is ok
    assert reason in result.reason


# What the tiny simulated model (tools/sim_model) answers at temperature 0 to the old open canary question
# ("what is tensor parallelism?"): fluent words, no repetition, nothing empty. Only a pattern catches it.
FLUENT_GARBAGE = "The makes second start because nothing needs move twice Thinking step by helps hard problems"


def test_a_fluent_but_wrong_answer_fails_only_with_a_pattern_and_the_message_quotes_answer_and_pattern() -> None:
    assert h.evaluate_canary(200, chat_body(FLUENT_GARBAGE)).ok, "without a pattern any fluent text passes"
    result = h.evaluate_canary(200, chat_body(FLUENT_GARBAGE), r"(?i)\bparis\b")
    assert not result.ok and result.text == FLUENT_GARBAGE
    assert result.reason == ('canary answer "%s" does not match the pattern (?i)\\bparis\\b (glm53_canary_expect)'
                             % FLUENT_GARBAGE)
    # The production default accepts the answer however the model phrases it.
    for answer in ("Paris", "paris.", "The capital of France is Paris."):
        assert h.evaluate_canary(200, chat_body(answer), r"(?i)\bparis\b").ok, answer
    assert not h.evaluate_canary(200, chat_body("Comparison"), r"(?i)\bparis\b").ok


def test_a_long_wrong_answer_is_quoted_shortened() -> None:
    result = h.evaluate_canary(200, chat_body("word " * 200), "Paris")
    assert len(result.reason) < h.CANARY_TEXT_LIMIT + 100 and result.text == "word " * 200


def test_pattern_error_names_the_pattern() -> None:
    assert h.pattern_error(None) is None and h.pattern_error("") is None and h.pattern_error(r"^The\b") is None
    assert h.pattern_error("paris(") == "missing ), unterminated subpattern at position 5 in 'paris('"


def test_api_headers_only_carry_a_key_when_set() -> None:
    assert "Authorization" not in h.api_headers(None)
    assert h.api_headers("sk-1")["Authorization"] == "Bearer sk-1"


# --------------------------------------------------------------------------- the loop, scripted I/O


class ScriptedIO:
    """Clock advances only by sleep; docker and HTTP answers come from per-call scripts."""

    def __init__(self, inspect: Dict[str, List[str]], health: List[int], models: str = models_body(MODEL),
                 chat: Tuple[int, str] = (200, chat_body("Paris."))) -> None:
        self.now = 0.0
        self.inspect = inspect
        self.health = health
        self.models = models
        self.chat = chat
        self.calls: List[str] = []
        self.progress: List[Dict[str, object]] = []

    def run(self, argv, timeout, merge):  # type: ignore[no-untyped-def]
        text = " ".join(argv)
        self.calls.append(text)
        name = text.split()[-1] if "inspect" in text else text.split("--tail")[1].split()[1]
        if "inspect" in text:
            script = self.inspect[name]
            line = script.pop(0) if len(script) > 1 else script[0]
            return 0, line + "\n", ""
        return 0, "line one\nlast words of %s\n" % name, ""

    def http(self, method, url, headers, body, timeout):  # type: ignore[no-untyped-def]
        self.calls.append("%s %s" % (method, url))
        if url.endswith("/health"):
            status = self.health.pop(0) if len(self.health) > 1 else self.health[0]
            return h.HttpResult(status) if status else h.HttpResult(0, error="refused")
        if url.endswith("/v1/models"):
            return h.HttpResult(200, self.models)
        return h.HttpResult(*self.chat)

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def io(self, progress: bool = False) -> h.HealthIO:
        return h.HealthIO(self.run, self.http, lambda: self.now, self.sleep,
                          self.progress.append if progress else None)


def config(**kw) -> h.HealthConfig:  # type: ignore[no-untyped-def]
    base = dict(url="http://head:8888/", served_model_name=MODEL, ranks=[HEAD, WORKER], timeout=60,
                poll_interval=5, log_tail=10, warmup_requests=2)
    base.update(kw)
    return h.HealthConfig(**base)  # type: ignore[arg-type]


def test_loop_ready_then_warmup_and_canary() -> None:
    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["running 0"]}, [0, 503, 200])
    outcome = h.HealthWaiter(config(), io.io(progress=True)).run()
    assert not outcome.failed, outcome.msg
    r = outcome.result
    assert r["changed"] is False and r["ready"] is True and r["phase"] == "ready"
    assert r["polls"] == 3 and r["ready_after_s"] == 10
    assert r["models"] == [MODEL] and r["canary_text"] == "Paris." and r["warmup_statuses"] == [200, 200]
    assert sum(c.startswith("POST") for c in io.calls) == 3
    assert [p["phase"] for p in io.progress][:2] == ["waiting_health", "waiting_health"]
    assert io.progress[0]["last_log_line"] == "last words of glm53-rank0"
    assert io.progress[-1]["phase"] == "ready"


def test_loop_fails_fast_naming_the_dead_worker() -> None:
    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["running 0", "exited 137"]}, [0])
    outcome = h.HealthWaiter(config(), io.io()).run()
    assert outcome.failed
    assert "rank 1 on node spark2" in outcome.msg and "exit code 137" in outcome.msg
    r = outcome.result
    assert (r["failed_rank"], r["failed_node"], r["failed_container"]) == (1, "spark2", "glm53-rank1")
    assert r["log_tail"][-1] == "last words of glm53-rank1" and r["polls"] == 2
    assert any(c.startswith("ssh -o BatchMode=yes") and "logs --tail 10" in c for c in io.calls)


def test_loop_names_the_rank_that_died_first_when_the_head_followed_it() -> None:
    # A worker killed while serving takes the head's engine down with it; the worker is the cause.
    io = ScriptedIO({"glm53-rank0": ["running 0 0001-01-01T00:00:00Z", "exited 1 2026-11-30T19:01:09.3Z"],
                     "glm53-rank1": ["running 0 0001-01-01T00:00:00Z", "exited 137 2026-11-30T19:01:02Z"]}, [0])
    outcome = h.HealthWaiter(config(), io.io()).run()
    assert outcome.failed and outcome.msg.startswith("rank 1 on node spark2 (container glm53-rank1) failed")
    assert "first of 2; then rank 0 on node spark1" in outcome.msg
    r = outcome.result
    assert (r["failed_rank"], r["failed_node"], r["failed_at"]) == (1, "spark2", "2026-11-30T19:01:02Z")
    assert [d["rank"] for d in r["failed_ranks"]] == [1, 0]
    assert r["log_tail"][-1] == "last words of glm53-rank1"


def test_loop_fails_after_three_polls_without_container() -> None:
    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["missing"]}, [0])
    io.inspect["glm53-rank1"] = ["created 0"]
    outcome = h.HealthWaiter(config(), io.io()).run()
    assert outcome.failed and outcome.result["polls"] == 3 and outcome.result["failed_rank"] == 1


def test_loop_times_out_with_head_logs() -> None:
    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["running 0"]}, [503])
    outcome = h.HealthWaiter(config(timeout=20), io.io()).run()
    assert outcome.failed and "not ready after 20" in outcome.msg and "HTTP 503" in outcome.msg
    assert outcome.result["log_tail"][-1] == "last words of glm53-rank0"
    assert outcome.result["polls"] == 5


def test_loop_fails_at_once_on_wrong_served_model() -> None:
    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["running 0"]}, [200], models=models_body("x"))
    outcome = h.HealthWaiter(config(), io.io()).run()
    assert outcome.failed and outcome.result["polls"] == 1 and outcome.result["models"] == ["x"]


def test_loop_canary_failure_carries_the_body() -> None:
    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["running 0"]}, [200],
                    chat=(200, chat_body("!!!!!!!!!!!!!!!!")))
    outcome = h.HealthWaiter(config(), io.io()).run()
    assert outcome.failed and "degenerate" in outcome.msg
    assert "!!!!" in outcome.result["canary_body"] and outcome.result["canary_status"] == 200


def test_loop_empty_canary_answer_fails_with_finish_reason_and_token_count() -> None:
    # What an engine that emits end-of-sequence at once looks like: HTTP 200, no text, one token.
    empty = json.dumps({"choices": [{"message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}],
                        "usage": {"completion_tokens": 1}})
    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["running 0"]}, [200], chat=(200, empty))
    outcome = h.HealthWaiter(config(), io.io()).run()
    assert outcome.failed and outcome.msg == "vLLM answers /health but the canary failed: canary answer is empty"
    r = outcome.result
    assert (r["canary_status"], r["canary_finish_reason"], r["canary_completion_tokens"]) == (200, "stop", 1)
    assert r["canary_text"] == "" and '"completion_tokens": 1' in r["canary_body"]


def test_probe_reports_without_failing() -> None:
    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["exited 1"]}, [0])
    result = h.HealthWaiter(config(), io.io()).probe()
    assert result["ready"] is False and result["failed_rank"] == 1 and "rank_failure" in result
    assert not any(c.startswith("POST") for c in io.calls)
    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["running 0"]}, [200])
    result = h.HealthWaiter(config(), io.io()).probe()
    assert result["ready"] is True and result["models"] == [MODEL] and result["polls"] == 1


def test_one_look_without_waiting_asks_the_canary_only_of_a_serving_engine_and_fails_only_for_a_dead_rank() -> None:
    ranks = {"glm53-rank0": ["running 0"], "glm53-rank1": ["running 0"]}
    io = ScriptedIO(dict(ranks), [503])
    outcome = h.HealthWaiter(config(wait=False), io.io()).run()
    assert not outcome.failed and outcome.result["ready"] is False, outcome.msg
    assert outcome.result["polls"] == 1 and io.now == 0 and "not waited for" in outcome.msg
    assert not any(c.startswith("POST") for c in io.calls)

    io = ScriptedIO(dict(ranks), [200])
    outcome = h.HealthWaiter(config(wait=False), io.io()).run()
    assert not outcome.failed and outcome.result["ready"] is True and outcome.result["canary_text"] == "Paris."
    assert sum(c.startswith("POST") for c in io.calls) == 3  # two warm-ups and the canary, as when waiting

    io = ScriptedIO(dict(ranks), [200], chat=(200, chat_body("")))
    assert h.HealthWaiter(config(wait=False), io.io()).run().failed

    io = ScriptedIO({"glm53-rank0": ["running 0"], "glm53-rank1": ["exited 139"]}, [503])
    outcome = h.HealthWaiter(config(wait=False), io.io()).run()
    assert outcome.failed and outcome.result["failed_rank"] == 1


def test_progress_file_writer_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    write = h.progress_file_writer(str(path))
    write({"phase": "a"})
    write({"phase": "b", "elapsed_s": 1.5})
    assert json.loads(path.read_text()) == {"phase": "b", "elapsed_s": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


# --------------------------------------------------------------------------- the loop for real

FAKE_DOCKER = """#!{python}
# Test double for the docker CLI: `inspect` answers from STATE_DIR/<name>.states, one line per call
# (the last line repeats); `logs` prints STATE_DIR/<name>.log.
import os, sys
state = os.environ["FAKE_DOCKER_DIR"]
args = sys.argv[1:]
name = args[-1]
if args[0] == "inspect":
    path = os.path.join(state, name + ".states")
    if not os.path.exists(path):
        sys.stderr.write("Error: No such object: %s\\n" % name)
        sys.exit(1)
    count_path = path + ".n"
    n = int(open(count_path).read()) if os.path.exists(count_path) else 0
    open(count_path, "w").write(str(n + 1))
    lines = open(path).read().split()
    pairs = [lines[i:i + 2] for i in range(0, len(lines), 2)]
    print(" ".join(pairs[min(n, len(pairs) - 1)]))
elif args[0] == "logs":
    sys.stdout.write(open(os.path.join(state, name + ".log")).read())
else:
    sys.exit(2)
"""


class FakeVllm(BaseHTTPRequestHandler):
    """/health answers 503 for the first `health_503` requests, then 200; /v1/models and chat as vLLM."""

    health_503 = 2
    answer = "Paris is the capital of France."
    seen: List[Dict[str, object]] = []

    def log_message(self, *args: object) -> None:
        pass

    def reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            cls = type(self)
            if cls.health_503 > 0:
                cls.health_503 -= 1
                self.reply(503, {})
            else:
                self.reply(200, {})
        elif self.path == "/v1/models":
            if self.headers.get("Authorization") != "Bearer sk-test":
                self.reply(401, {"error": "unauthorized"})
            else:
                self.reply(200, {"object": "list", "data": [{"id": MODEL}]})
        else:
            self.reply(404, {})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length", "0"))
        type(self).seen.append(json.loads(self.rfile.read(length)))
        self.reply(200, json.loads(chat_body(self.answer)))


@pytest.fixture
def fake_vllm() -> Iterator[str]:
    FakeVllm.health_503 = 2
    FakeVllm.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield "http://127.0.0.1:%d" % server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    state = tmp_path / "docker"
    bin_dir.mkdir()
    state.mkdir()
    script = bin_dir / "docker"
    script.write_text(FAKE_DOCKER.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", "%s%s%s" % (bin_dir, os.pathsep, os.environ["PATH"]))
    monkeypatch.setenv("FAKE_DOCKER_DIR", str(state))
    (state / "glm53-rank0.log").write_text("INFO loading weights\nINFO capturing CUDA graphs\n")
    (state / "glm53-rank1.log").write_text("INFO init\nncclCommInitRank failed: unhandled system error\n")
    return state


def real_config(url: str, **kw) -> h.HealthConfig:  # type: ignore[no-untyped-def]
    base = dict(url=url, served_model_name=MODEL, api_key="sk-test", timeout=30, poll_interval=0.05,
                ranks=[h.Rank(0, "spark1", "glm53-rank0"), h.Rank(1, "spark2", "glm53-rank1")],
                canary=h.Canary(expect_regex="Paris"))
    base.update(kw)
    return h.HealthConfig(**base)  # type: ignore[arg-type]


def real_io(progress_path: Optional[Path] = None) -> h.HealthIO:
    progress = h.progress_file_writer(str(progress_path)) if progress_path else None
    return h.HealthIO(h.subprocess_runner, h.urllib_http, progress=progress)


def test_real_loop_fails_within_a_few_polls_when_a_rank_exits(fake_vllm: str, fake_docker: Path) -> None:
    FakeVllm.health_503 = 10_000
    (fake_docker / "glm53-rank0.states").write_text("running 0\n")
    (fake_docker / "glm53-rank1.states").write_text("running 0\nrunning 0\nexited 1\n")
    outcome = h.HealthWaiter(real_config(fake_vllm), real_io()).run()
    assert outcome.failed
    # Three polls, not the 30 s timeout waited out: the bound is half that, so a loaded machine does not fail it.
    assert outcome.result["polls"] == 3 and outcome.result["elapsed_s"] < 15
    assert "rank 1 on node spark2 (container glm53-rank1)" in outcome.msg and "exit code 1" in outcome.msg
    assert outcome.result["log_tail"][-1] == "ncclCommInitRank failed: unhandled system error"


def test_real_loop_serves_and_passes_canary(fake_vllm: str, fake_docker: Path, tmp_path: Path) -> None:
    for rank in (0, 1):
        (fake_docker / ("glm53-rank%d.states" % rank)).write_text("running 0\n")
    progress = tmp_path / "progress.json"
    outcome = h.HealthWaiter(real_config(fake_vllm), real_io(progress)).run()
    assert not outcome.failed, outcome.msg
    assert outcome.result["polls"] == 3 and outcome.result["canary_text"].startswith("Paris")
    assert len(FakeVllm.seen) == 2 and FakeVllm.seen[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert json.loads(progress.read_text())["phase"] == "ready"


def test_real_loop_reports_missing_docker_container(fake_vllm: str, fake_docker: Path) -> None:
    (fake_docker / "glm53-rank0.states").write_text("running 0\n")
    outcome = h.HealthWaiter(real_config(fake_vllm), real_io()).run()
    assert outcome.failed and outcome.result["failed_rank"] == 1 and "missing" in outcome.msg


def run_module(name: str, args: Dict[str, object], env: Optional[Dict[str, str]] = None) -> Dict[str, object]:
    """Execute a module file the way Ansible's module runner does, minus the zip wrapper."""
    argv = [sys.executable, str(REPO / "plugins" / "modules" / ("%s.py" % name))]
    full_env = dict(os.environ, PYTHONPATH=str(REPO / ".collections"), **(env or {}))
    proc = subprocess.run(argv, input=json.dumps({"ANSIBLE_MODULE_ARGS": args}).encode(), capture_output=True,
                          env=full_env, timeout=60, check=False)
    assert proc.stdout, proc.stderr.decode()
    return json.loads(proc.stdout)


def test_module_fails_naming_the_rank(fake_vllm: str, fake_docker: Path) -> None:
    (fake_docker / "glm53-rank0.states").write_text("running 0\n")
    (fake_docker / "glm53-rank1.states").write_text("running 0\nexited 137\n")
    result = run_module("vllm_health", {
        "url": fake_vllm, "served_model_name": MODEL, "api_key": "sk-test", "poll_interval": 0.05,
        "timeout": 30, "log_tail": 5,
        "ranks": [{"rank": 0, "node": "spark1", "container": "glm53-rank0"},
                  {"rank": 1, "node": "spark2", "container": "glm53-rank1"}],
    })
    assert result["failed"] is True and result["failed_rank"] == 1 and result["failed_node"] == "spark2"
    assert "sk-test" not in json.dumps(result)


def test_module_check_mode_probes_once(fake_vllm: str, fake_docker: Path) -> None:
    for rank in (0, 1):
        (fake_docker / ("glm53-rank%d.states" % rank)).write_text("running 0\n")
    result = run_module("vllm_health", {
        "url": fake_vllm, "served_model_name": MODEL, "api_key": "sk-test", "_ansible_check_mode": True,
        "ranks": [{"rank": 0, "node": "spark1", "container": "glm53-rank0"}],
    })
    assert not result.get("failed") and result["ready"] is False and result["changed"] is False
    assert result["polls"] == 1 and FakeVllm.seen == []


# --------------------------------------------------------------------------- action plugin, real playbook

PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - sparkops.glm53.vllm_health:
        url: "{url}"
        served_model_name: "%s"
        api_key: sk-test
        poll_interval: 0.2
        timeout: 60
        ranks:
          - {{rank: 0, node: spark1, container: glm53-rank0}}
          - {{rank: 1, node: spark2, container: glm53-rank1}}
""" % MODEL


def test_progress_line_format() -> None:
    from ansible_collections.sparkops.glm53.plugins.action.vllm_health import progress_line

    line = progress_line({"elapsed_s": 61.4, "phase": "waiting_health", "last_log_line": "Loading shard 3/40"}, "s1")
    assert line == "vllm_health [s1]   61s waiting_health | Loading shard 3/40"
    assert progress_line({}, "s1") == "vllm_health [s1]    0s ?"


def run_play(url: str, tmp_path: Path, *options: str) -> "subprocess.CompletedProcess[str]":
    """PLAY against URL through the action plugin, as ansible-playbook runs it (async jobs in tmp_path/async)."""
    play = tmp_path / "play.yml"
    play.write_text(PLAY.format(url=url))
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(REPO / ".collections"),
               ANSIBLE_ASYNC_DIR=str(tmp_path / "async"),
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "local"), ANSIBLE_REMOTE_TMP=str(tmp_path / "remote"),
               ANSIBLE_STDOUT_CALLBACK="ansible.builtin.default", ANSIBLE_NOCOLOR="1", ANSIBLE_CALLBACK_RESULT_FORMAT="json")
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", "ansible_python_interpreter=%s" % sys.executable, *options, str(play)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def test_action_plugin_runs_module_in_background_and_returns_its_failure(
        fake_vllm: str, fake_docker: Path, tmp_path: Path) -> None:
    FakeVllm.health_503 = 10_000
    (fake_docker / "glm53-rank0.states").write_text("running 0\n")
    (fake_docker / "glm53-rank1.states").write_text("running 0\nexited 139\n")
    proc = run_play(fake_vllm, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert '"failed_rank": 1' in proc.stdout and '"failed_node": "spark2"' in proc.stdout
    assert "ncclCommInitRank failed" in proc.stdout and "sk-test" not in proc.stdout
    assert os.listdir(tmp_path / "async") == []  # job file cleaned up


def test_action_plugin_asks_a_serving_engine_in_the_foreground_without_a_background_job(
        fake_vllm: str, fake_docker: Path, tmp_path: Path) -> None:
    FakeVllm.health_503 = 0
    for rank in (0, 1):
        (fake_docker / ("glm53-rank%d.states" % rank)).write_text("running 0\n")
    proc = run_play(fake_vllm, tmp_path, "-v")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '"ready": true' in proc.stdout and '"canary_text": "Paris is the capital of France."' in proc.stdout
    assert "ansible_job_id" not in proc.stdout
    assert not (tmp_path / "async").exists(), "a background job was started for an engine that already served"
