"""The bench CLI (python -m tools.bench) end to end against a stdlib stand-in for vLLM's OpenAI server on 127.0.0.1.

The stand-in replays the recorded streams (100x faster) and moves its spec-decode and prefix-cache
counters by a fixed amount per request, so the deltas the CLI reports are known exactly. The real
engine is measured by the playbook on real or simulated Sparks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tools.bench import cli as bench_decode
from tools.bench.report_schema import validate_report

REPO = Path(__file__).resolve().parents[4]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "bench"
MODEL = "GLM-5.3-Flash-EXL3"
KEY = "sk-bench-test"
TIME_SCALE = 0.01
PER_POS = [18, 15, 11, 8, 6, 4, 2]  # accepted per position per request; 64 accepted over 20 drafts of 7


def timed_events(name: str) -> list[tuple[float, bytes]]:
    """(arrival time, raw SSE event) pairs of a recording, sent as recorded (the comments included)."""
    out: list[tuple[float, bytes]] = []
    for block in (FIXTURES / name).read_text().split("\n\n"):
        times = [float(line[4:]) for line in block.splitlines() if line.startswith(": t=")]
        if "data:" in block:
            out.append((times[0] if times else out[-1][0], (block + "\n\n").encode()))
    return out


class FakeVllm:
    def __init__(self, health: int = 200, busy_scrapes: int = 0) -> None:
        self.health = health
        self.busy_scrapes = busy_scrapes
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.lock = threading.Lock()
        self.drafts = self.accepted = self.queries = self.hits = 0
        self.per_pos = [0] * len(PER_POS)
        self.streams = {"structured": timed_events("structured_dflash.sse"),
                        "prose": timed_events("prose_dflash.sse")}

    def count_request(self) -> None:
        with self.lock:
            self.drafts += 20
            self.accepted += sum(PER_POS)
            self.per_pos = [a + b for a, b in zip(self.per_pos, PER_POS)]
            self.queries += 17
            self.hits += 16

    def metrics_text(self) -> str:
        with self.lock:
            busy = 1 if self.busy_scrapes > 0 else 0
            self.busy_scrapes -= 1
            labels = f'engine="0",model_name="{MODEL}"'
            values = {
                "vllm:num_requests_running": ("gauge", busy), "vllm:num_requests_waiting": ("gauge", 0),
                "vllm:prefix_cache_queries_total": ("counter", self.queries),
                "vllm:prefix_cache_hits_total": ("counter", self.hits),
                "vllm:spec_decode_num_drafts_total": ("counter", self.drafts),
                "vllm:spec_decode_num_draft_tokens_total": ("counter", self.drafts * 7),
                "vllm:spec_decode_num_accepted_tokens_total": ("counter", self.accepted),
            }
            lines = [line for name, (kind, value) in values.items()
                     for line in (f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}.0")]
            lines += [
                "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
                *(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{p}"}} {v}.0'
                  for p, v in enumerate(self.per_pos)),
            ]
            return "\n".join(lines) + "\n"


def make_handler(fake: FakeVllm) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/health":
                self._send(fake.health, b"" if fake.health == 200 else b'{"error":"engine dead"}')
            elif self.path == "/metrics":
                self._send(200, fake.metrics_text().encode(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 900000}]}).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with fake.lock:
                fake.bodies.append(body)
                fake.auth.append(self.headers.get("Authorization"))
            events = fake.streams["prose" if "hash map" in body["messages"][0]["content"] else "structured"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
            start = time.perf_counter()
            for t, raw in events:
                time.sleep(max(0.0, start + t * TIME_SCALE - time.perf_counter()))
                self.wfile.write(raw)
                self.wfile.flush()
            fake.count_request()  # vLLM has counted the request by the time its stream ends
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[tuple[FakeVllm, str]]:
    fake = FakeVllm(**getattr(request, "param", {}))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(fake))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield fake, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GLM53_API_KEY": KEY, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "tools.bench", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("fake_server", [{"health": 503}], indirect=True)
def test_exits_2_when_health_fails(fake_server: tuple[FakeVllm, str], tmp_path: Path) -> None:
    fake, url = fake_server
    done = run_cli("--base-url", url, "--model", MODEL, "--out", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "/health answered HTTP 503" in done.stderr and "engine dead" in done.stderr
    assert fake.bodies == [] and list(tmp_path.iterdir()) == []


def test_exits_2_when_nothing_listens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = httpd.server_address[1]
    httpd.server_close()  # a port that was just free and now refuses connections
    assert bench_decode.main(["--base-url", f"http://127.0.0.1:{port}", "--model", MODEL, "--out", str(tmp_path)]) == 2
    assert "health failed" in capsys.readouterr().err


@pytest.mark.parametrize("fake_server", [{"busy_scrapes": 3}], indirect=True)
def test_exits_2_when_the_server_stays_busy(fake_server: tuple[FakeVllm, str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    fake, url = fake_server
    code = bench_decode.main(["--base-url", url, "--model", MODEL, "--out", str(tmp_path),
                              "--warmup-wait", "0.1", "--poll-interval", "0.05"])
    assert code == 2 and "still busy" in capsys.readouterr().err and fake.bodies == []


@pytest.mark.parametrize("fake_server", [{"busy_scrapes": 2}], indirect=True)
def test_end_to_end_writes_json_and_png(fake_server: tuple[FakeVllm, str], tmp_path: Path) -> None:
    fake, url = fake_server
    info = tmp_path / "server-info.json"
    spec = {"method": "dflash", "model": "/models/draft", "num_speculative_tokens": 7}
    info.write_text(json.dumps({"serve_argv": ["serve", "/models/glm", "--speculative-config", json.dumps(spec)]}))
    out = tmp_path / "results"
    done = run_cli("--base-url", url + "/v1", "--model", MODEL, "--runs", "2", "--max-tokens", "64",
                   "--concurrency", "1,2", "--phases", "structured,prose", "--out", str(out),
                   "--warmup-wait", "10", "--poll-interval", "0.05", "--coherence", "--server-info", str(info))
    assert done.returncode == 0, done.stdout + done.stderr

    [json_path] = out.glob("bench-*.json")
    [png_path] = out.glob("bench-*.png")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"results: {json_path}" in done.stdout and f"plot: {png_path}" in done.stdout
    assert "structured" in done.stdout and "decode med" in done.stdout  # the rich table

    report = json.loads(json_path.read_text())
    assert validate_report(report) == []
    assert report["target"] == {"base_url": url, "model": MODEL}
    assert report["server"]["spec_config"] == spec and report["server"]["spec_decode_metrics"] is True
    assert report["server"]["idle_wait_s"] > 0  # waited out the two busy scrapes
    assert report["server"]["models"]["data"][0]["id"] == MODEL
    assert report["coherence"]["passed"] is True and len(report["coherence"]["probes"]) == 3
    assert report["artifacts"]["plot"] == png_path.name and report["warnings"] == []

    structured, prose = report["phases"]
    assert [lvl["concurrency"] for lvl in structured["levels"]] == [1, 2]
    for phase, tokens in ((structured, 120), (prose, 80)):
        for level in phase["levels"]:
            n = 2 * level["concurrency"]
            assert len(level["requests"]) == n and level["errors"] == 0
            assert level["summary"]["completion_tokens"]["median"] == tokens
            assert level["summary"]["decode_tok_s"]["n"] == n and level["aggregate_tok_s"] > 0
            # exactly this level's requests in the counter deltas: no warm-up, no coherence probe
            assert level["spec_decode"]["drafts"] == 20 * n
            assert level["spec_decode"]["acceptance_ratio"] == pytest.approx(64 / 140)
            assert level["spec_decode"]["mean_acceptance_length"] == pytest.approx(1 + 64 / 20)
            assert level["spec_decode"]["per_position"][0]["rate"] == pytest.approx(18 / 20)
            assert level["prefix_cache"] == {"queries": 17 * n, "hits": 16 * n, "hit_rate": pytest.approx(16 / 17)}
    assert structured["spec_decode"]["drafts"] == 20 * 6

    # 3 probes + 1 warm-up + (2 + 4) structured + (2 + 4) prose, all with the recipe's sampling
    assert len(fake.bodies) == 16 and set(fake.auth) == {f"Bearer {KEY}"}
    assert sorted(b["max_tokens"] for b in fake.bodies).count(64) == 12
    assert sum(1 for b in fake.bodies if b["max_tokens"] == 32) == 1
    for body in fake.bodies:
        assert body["stream"] is True and body["temperature"] == 0 and body["top_p"] == 1
        assert body["stream_options"] == {"include_usage": True}
        assert body["chat_template_kwargs"] == {"enable_thinking": False}  # top level, not nested
        assert body["model"] == MODEL
