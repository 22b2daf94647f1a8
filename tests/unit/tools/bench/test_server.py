"""Waiting for an idle server, the --server-info file, and the coherence rule, without a network."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest


from tools.bench.phases import PHASES, check_answer
from tools.bench.prometheus_deltas import Snapshot, parse_metrics
from tools.bench.server_info import load_server_info, serve_argv, spec_config
from tools.bench.server_probe import ServerError, wait_until_idle

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "bench"
IDLE = parse_metrics((FIXTURES / "metrics_before.txt").read_text())
BUSY = parse_metrics((FIXTURES / "metrics_busy.txt").read_text())


def scripted(*scrapes: Snapshot | None) -> Callable[[], Snapshot | None]:
    """/metrics answers in order; the last one repeats."""
    queue = list(scrapes)
    return lambda: queue.pop(0) if len(queue) > 1 else queue[0]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_waits_for_two_quiet_polls_after_the_launch_traffic() -> None:
    clock = FakeClock()
    server = scripted(BUSY, BUSY, IDLE, BUSY, IDLE, IDLE)
    waited = wait_until_idle(server, timeout_s=60, poll_s=1.0, clock=clock, sleep=clock.sleep)
    # one quiet poll followed by a busy one starts the count again
    assert waited == 5.0


def test_gives_up_when_the_server_stays_busy() -> None:
    clock = FakeClock()
    with pytest.raises(ServerError, match=r"still busy after 10 s \(1 running, 2 waiting"):
        wait_until_idle(scripted(BUSY), timeout_s=10, poll_s=1.0, clock=clock, sleep=clock.sleep)


def test_unknowable_idle_state_does_not_block() -> None:
    clock = FakeClock()
    assert wait_until_idle(scripted(None), timeout_s=10, clock=clock, sleep=clock.sleep) is None
    assert clock.now == 0.0


def test_spec_config_from_the_rendered_serve_argv(tmp_path: Path) -> None:
    spec = {"draft_tensor_parallel_size": 1, "method": "dflash", "model": "/models/draft",
            "num_speculative_tokens": 7}
    argv = ["serve", "/models/glm", "--port", "8888", "--speculative-config", json.dumps(spec)]
    path = tmp_path / "server-info.json"
    path.write_text(json.dumps({"serve_argv": argv}))
    info = load_server_info(path)
    assert serve_argv(info) == argv and spec_config(info) == spec
    assert spec_config({"serve_argv": ['--speculative-config={"method":"mtp","num_speculative_tokens":2}']}) == {
        "method": "mtp", "num_speculative_tokens": 2}
    assert spec_config({"serve_argv": ["serve", "/models/glm"]}) is None
    assert spec_config({"speculative_config": {"method": "ngram"}}) == {"method": "ngram"}
    assert spec_config(None) is None and serve_argv({"serve_argv": "serve x"}) is None
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_server_info(path)


@pytest.mark.parametrize("text,passed,reason", [
    ("The capital of France is Paris.", True, "ok"),
    ("  \n ", False, "empty answer"),
    ("!!!!!!!!!!!!!!!!!!!!!!!!", False, "one character repeated"),
    ("\ufffd\ufffd\ufffdabc", False, "printable"),
    ("\x00\x01\x02\x03 hi", False, "printable"),
    ("Rot, Gelb und Blau.\n", True, "ok"),
])
def test_coherence_rule(text: str, passed: bool, reason: str) -> None:
    ok, why = check_answer(text)
    assert ok is passed and reason in why


def test_phases_are_the_recipes_plus_code() -> None:
    assert list(PHASES) == ["structured", "prose", "code"]
    assert PHASES["structured"].prompt == "Count from 1 to 200, separated by commas."
    assert PHASES["structured"].warmup_tokens == 32
    assert PHASES["prose"].warmup_tokens is None
