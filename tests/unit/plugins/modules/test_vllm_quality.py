# SPDX-License-Identifier: MIT
"""vllm_quality as Ansible runs it, against a stdlib HTTP stand-in that answers /v1/completions the way
vLLM does (prompt_logprobs keyed by token id, with rank): a faithful server passes and leaves its report,
a flattened one fails naming the KLD, the threshold and the worst window, check mode only looks."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[4]
TOP_K = 4
VOCAB = 12


def log_softmax(logits: List[float]) -> List[float]:
    top = max(logits)
    norm = top + math.log(math.fsum(math.exp(x - top) for x in logits))
    return [x - norm for x in logits]


def teacher_dist(token: int) -> List[float]:
    """The teacher's next-token distribution after `token`: peaked on token + 1."""
    return log_softmax([4.0 if i == (token + 1) % VOCAB else 0.3 * ((i * 7 + token) % 5) for i in range(VOCAB)])


def top(logprobs: List[float], k: int) -> List[int]:
    return sorted(range(len(logprobs)), key=lambda i: -logprobs[i])[:k]


def write_set(root: Path) -> Path:
    windows = []
    for w, tokens in enumerate(([1, 2, 3, 4, 5, 6], [7, 8, 9, 10])):
        dists = [teacher_dist(t) for t in tokens[:-1]]
        windows.append({"id": "win-%d" % w, "kind": "text", "token_ids": tokens, "scored_from": 1,
                        "top_ids": [top(d, TOP_K) for d in dists],
                        "top_logprobs": [[d[i] for i in top(d, TOP_K)] for d in dists]})
    (root / "reference.json").write_text(json.dumps({"format": "sparkops-glm53-quality-reference", "version": 1,
                                                     "top_k": TOP_K, "windows_file": "windows.jsonl"}))
    (root / "windows.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows))
    return root


class FakeVllm(BaseHTTPRequestHandler):
    temperature = 1.0  # 1.0 is the teacher itself; higher flattens every distribution
    requests: List[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.reply(200, {"data": [{"id": "M"}]})

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeVllm.requests.append(request)
        k, prompt = request["prompt_logprobs"], request["prompt"]
        entries: List[Optional[Dict[str, dict]]] = [None]
        for prev, token in zip(prompt, prompt[1:]):
            served = log_softmax([x / FakeVllm.temperature for x in teacher_dist(prev)])
            order = top(served, VOCAB)
            listed = set(order[:k]) | {token}
            entries.append({str(t): {"logprob": served[t], "rank": order.index(t) + 1, "decoded_token": "x"}
                            for t in listed})
        self.reply(200, {"choices": [{"text": "x", "prompt_logprobs": entries}]})


@pytest.fixture()
def fake_vllm() -> Iterator[str]:
    FakeVllm.temperature, FakeVllm.requests = 1.0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield "http://127.0.0.1:%d" % server.server_address[1]
    server.shutdown()


def run_module(args: Dict[str, object], check_mode: bool = False) -> Dict[str, object]:
    module_args = dict(args, _ansible_check_mode=check_mode)
    proc = subprocess.run([sys.executable, str(REPO / "plugins" / "modules" / "vllm_quality.py")],
                          input=json.dumps({"ANSIBLE_MODULE_ARGS": module_args}).encode(), capture_output=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO / ".collections")), timeout=60, check=False)
    assert proc.stdout, proc.stderr.decode()
    return json.loads(proc.stdout)


def gate_args(url: str, root: Path, **extra: object) -> Dict[str, object]:
    return {"url": url, "served_model_name": "M", "reference_dir": str(write_set(root)), "reference_id": "sim/set@abc",
            "max_kld": 0.05, "min_top1": 0.9, "report_path": str(root / "out" / "last.json"), **extra}


def test_a_faithful_server_passes_and_the_report_is_written(fake_vllm: str, tmp_path: Path) -> None:
    result = run_module(gate_args(fake_vllm, tmp_path))
    assert not result.get("failed"), result["msg"]
    assert result["passed"] and result["kld"] == pytest.approx(0.0, abs=1e-9) and result["top1"] == 1.0
    assert result["changed"] is False
    report = json.loads((tmp_path / "out" / "last.json").read_text())
    assert report == result["report"] and report["positions"] == 8 and report["reference"]["id"] == "sim/set@abc"
    assert [r["prompt"] for r in FakeVllm.requests] == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
    assert all(r["prompt_logprobs"] == TOP_K and r["max_tokens"] == 1 for r in FakeVllm.requests)


def test_a_flattened_server_fails_naming_the_kld_the_threshold_and_the_worst_window(fake_vllm: str,
                                                                                    tmp_path: Path) -> None:
    FakeVllm.temperature = 2.5
    result = run_module(gate_args(fake_vllm, tmp_path))
    assert result["failed"] and not result["passed"]
    assert "mean KLD" in result["msg"] and "> max_kld 0.05" in result["msg"] and "worst windows: win-" in result["msg"]
    # The report of a failed gate is evidence too.
    assert json.loads((tmp_path / "out" / "last.json").read_text())["passed"] is False


def test_check_mode_reads_the_set_and_sends_no_window(fake_vllm: str, tmp_path: Path) -> None:
    result = run_module(gate_args(fake_vllm, tmp_path), check_mode=True)
    assert not result.get("failed") and result["would_score"] == {"windows": 2, "positions": 8, "top_k": TOP_K}
    assert result["api"] == "HTTP 200" and FakeVllm.requests == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [{"max_kld": -1.0}, {"min_top1": 1.5}])
def test_thresholds_out_of_range_are_refused(fake_vllm: str, tmp_path: Path, bad: Dict[str, float]) -> None:
    result = run_module(gate_args(fake_vllm, tmp_path, **bad))
    assert result["failed"] and "max_kld must be >= 0, min_top1 within 0..1" in result["msg"]


def test_a_missing_set_is_named(fake_vllm: str, tmp_path: Path) -> None:
    args = gate_args(fake_vllm, tmp_path)
    args["reference_dir"] = str(tmp_path / "nowhere")
    result = run_module(args)
    assert result["failed"] and "cannot read the reference set in %s" % (tmp_path / "nowhere") in result["msg"]


def test_a_pass_is_reused_for_the_same_running_ranks_and_measured_again_for_new_ones(fake_vllm: str,
                                                                                     tmp_path: Path) -> None:
    first = run_module(gate_args(fake_vllm, tmp_path, served_by="abc@T1"))
    assert first["passed"] and "reused" not in first and len(FakeVllm.requests) == 2
    again = run_module(gate_args(fake_vllm, tmp_path, served_by="abc@T1"))
    assert again["reused"] is True and again["passed"] and len(FakeVllm.requests) == 2, again
    assert "not measured again" in again["msg"] and again["report"] == first["report"]
    # New ranks (a restart), other thresholds or no identity at all: measured.
    for extra in ({"served_by": "abc@T2"}, {"served_by": "abc@T2", "max_kld": 0.04}, {"served_by": ""}):
        before = len(FakeVllm.requests)
        result = run_module(gate_args(fake_vllm, tmp_path, **extra))
        assert "reused" not in result and len(FakeVllm.requests) == before + 2, (extra, result)


def test_a_failed_report_is_never_reused(fake_vllm: str, tmp_path: Path) -> None:
    FakeVllm.temperature = 2.5
    assert run_module(gate_args(fake_vllm, tmp_path, served_by="abc@T1"))["failed"]
    FakeVllm.temperature = 1.0
    result = run_module(gate_args(fake_vllm, tmp_path, served_by="abc@T1"))
    assert result["passed"] and "reused" not in result
