"""The glm53 node collector (roles/monitoring/files/glm53_node_collector.py): what it writes from real inputs."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[4]
FIXTURES = REPO / "tests/unit/fixtures"
_spec = importlib.util.spec_from_file_location("glm53_node_collector", REPO / "roles/monitoring/files/glm53_node_collector.py")
collector = importlib.util.module_from_spec(_spec)
# dataclasses look their module up in sys.modules while the class body runs.
sys.modules[_spec.name] = collector
_spec.loader.exec_module(collector)


def _parse(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_unified_memory_counts_page_cache_separately_from_free():
    meminfo = collector.parse_meminfo((FIXTURES / "meminfo/gb10-after-rsync.txt").read_text())
    samples = {s.name: s.value for s in collector.memory_samples(meminfo)}
    assert samples["glm53_unified_memory_total_bytes"] == 126764396 * 1024
    # After an rsync of the weights almost the whole pool is page cache: free is small, available is not.
    assert samples["glm53_unified_memory_free_bytes"] == 5767168 * 1024
    assert samples["glm53_unified_memory_available_bytes"] == 119799808 * 1024
    assert samples["glm53_unified_memory_page_cache_bytes"] == (114753536 + 131072) * 1024


def test_meminfo_without_memavailable_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="MemAvailable"):
        collector.memory_samples(collector.parse_meminfo("MemTotal: 100 kB\nMemFree: 50 kB\n"))


def test_gpu_readings_the_gpu_does_not_report_are_absent():
    samples = collector.gpu_samples((FIXTURES / "monitoring/nvidia-smi-gb10.csv").read_text())
    got = {(s.name, s.labels.get("clock")): s.value for s in samples}
    assert got[("glm53_gpu_temperature_celsius", None)] == 47
    assert got[("glm53_gpu_clock_hertz", "graphics")] == 2405e6
    assert got[("glm53_gpu_power_watts", None)] == pytest.approx(31.52)
    assert got[("glm53_gpu_utilization_ratio", None)] == pytest.approx(0.88)
    assert ("glm53_gpu_clock_hertz", "memory") not in got
    assert all(s.labels["gpu"] == "0" for s in samples)


def test_gpu_row_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="expected 7"):
        collector.gpu_samples("0, 47, 2405\n")


def test_thermal_zones_skip_unreadable_and_number_repeats():
    samples = collector.thermal_samples([("acpitz", "45000"), ("cpu-thermal", "51500"), ("cpu-thermal", "53000"),
                                         ("broken", "error"), ("absent", "0")])
    assert [(s.labels["zone"], s.value) for s in samples] == [("acpitz", 45.0), ("cpu-thermal", 51.5), ("cpu-thermal1", 53.0)]


def test_exited_rank_reports_its_exit_code():
    inspect = json.loads((FIXTURES / "monitoring/docker-inspect-exited.json").read_text())
    got = {s.name: s.value for s in collector.container_samples("glm53-rank1", inspect)}
    assert got["glm53_rank_container_running"] == 0
    assert got["glm53_rank_container_exit_code"] == 3
    assert got["glm53_rank_container_restarts"] == 0
    assert got["glm53_rank_container_started_timestamp_seconds"] == pytest.approx(1796137104.760566, abs=1e-3)


def test_running_rank_has_no_exit_code_and_a_missing_rank_counts_as_down():
    running = {"State": {"Running": True, "ExitCode": 0, "StartedAt": "0001-01-01T00:00:00Z"}, "RestartCount": 2}
    got = {s.name: s.value for s in collector.container_samples("glm53-rank0", running)}
    assert got == {"glm53_rank_container_running": 1, "glm53_rank_container_restarts": 2}
    missing = collector.container_samples("glm53-rank0", None)
    assert [(s.name, s.value, s.labels) for s in missing] == [
        ("glm53_rank_container_running", 0, {"container": "glm53-rank0"})]


@pytest.mark.parametrize(("status", "body", "ok"), [
    (200, b'{"choices": [{"message": {"content": "Hi"}}], "usage": {"completion_tokens": 2}}', True),
    (200, b'{"choices": [{"message": {"content": ""}}], "usage": {"completion_tokens": 0}}', False),
    (200, b"not json", False),
    (503, b'{"usage": {"completion_tokens": 2}}', False),
])
def test_canary_needs_status_200_and_a_completion_token(status, body, ok):
    assert collector.canary_ok(status, body) is ok


def test_rendered_file_parses_with_prometheus_client_and_escapes_labels():
    text = collector.render([
        collector.Sample("glm53_rank_container_running", 1, {"container": 'odd"name', "rank": "0"}),
        collector.Sample("glm53_unified_memory_total_bytes", 126764396 * 1024),
    ])
    parsed = _parse(text)
    assert parsed[("glm53_rank_container_running", (("container", 'odd"name'), ("rank", "0")))] == 1
    assert parsed[("glm53_unified_memory_total_bytes", ())] == 129806741504
    with pytest.raises(KeyError, match="not declared"):
        collector.render([collector.Sample("glm53_undeclared", 1)])


class _ChatServer(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        reply = json.dumps({"choices": [{"message": {"content": "ok"}}], "usage": {"completion_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_one_pass_writes_an_atomic_file_node_exporter_can_read(tmp_path, monkeypatch):
    server = HTTPServer(("127.0.0.1", 0), _ChatServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    thermal = tmp_path / "thermal/thermal_zone0"
    thermal.mkdir(parents=True)
    (thermal / "type").write_text("soc\n")
    (thermal / "temp").write_text("48250\n")
    monkeypatch.setenv("TEST_KEY", "secret")
    out = tmp_path / "textfile"
    try:
        assert collector.main([
            "--out", str(out), "--once", "--meminfo", str(FIXTURES / "meminfo/sim-node.txt"),
            "--thermal-root", str(tmp_path / "thermal"), "--container", "glm53-rank0",
            "--docker-socket", str(tmp_path / "no-docker.sock"),
            "--canary-url", f"http://127.0.0.1:{server.server_port}", "--canary-model", "m",
            "--canary-api-key-env", "TEST_KEY"]) == 0
    finally:
        server.shutdown()
    assert [p.name for p in out.iterdir()] == ["glm53.prom"]
    assert oct((out / "glm53.prom").stat().st_mode & 0o777) == "0o644"
    parsed = _parse((out / "glm53.prom").read_text())
    assert parsed[("glm53_unified_memory_total_bytes", ())] == 24683652 * 1024
    assert parsed[("glm53_soc_temperature_celsius", (("zone", "soc"),))] == 48.25
    assert parsed[("glm53_canary_success", ())] == 1
    # The Docker API was unreachable: said so, not reported as a dead rank.
    assert parsed[("glm53_collector_source_ok", (("source", "docker"),))] == 0
    assert not any(key[0] == "glm53_rank_container_running" for key in parsed)
    assert _ChatServer.seen[-1]["auth"] == "Bearer secret"
    assert _ChatServer.seen[-1]["path"] == "/v1/chat/completions"


def test_container_state_through_the_real_docker_api_when_there_is_one():
    socket_path = "/var/run/docker.sock"
    if not os.access(socket_path, os.R_OK | os.W_OK):
        pytest.skip("no Docker socket on this machine")
    assert collector.docker_inspect(socket_path, "glm53-no-such-container-for-tests") is None
