# SPDX-License-Identifier: MIT
"""Per-node facts the engine does not export, as a node-exporter textfile (glm53.prom).

Runs in a sidecar container on every node (standard library only, so it runs in any image with a python3):
- the unified memory pool from /proc/meminfo, page cache included: on a GB10 the GPU allocates from the
  same pool, and page cache the kernel does not give back in time is what makes a model load fail;
- GPU temperature and clocks from nvidia-smi, and SoC thermal zones from sysfs, where readable: a value
  the hardware does not report is left out, never written as 0 (0 degrees would look like a reading);
- the state of this node's rank container through the Docker API (running, exit code, restarts): the
  worker ranks have no API of their own, so this is how a dead worker shows up in Prometheus;
- on the head, a periodic canary chat completion (a green /health does not prove the engine answers).

Each pass writes the whole file atomically (write, then rename), so node-exporter never reads half of it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

OUTPUT_NAME = "glm53.prom"

# name -> (type, help). Every metric this collector can write; the dashboard test checks panels against it.
METRICS: dict[str, tuple[str, str]] = {
    "glm53_unified_memory_total_bytes": ("gauge", "MemTotal of the node's unified memory pool (CPU and GPU share it)."),
    "glm53_unified_memory_free_bytes": ("gauge", "MemFree: memory nothing holds, page cache excluded."),
    "glm53_unified_memory_available_bytes": ("gauge", "MemAvailable: free plus what the kernel can reclaim (page cache, reclaimable slab)."),
    "glm53_unified_memory_page_cache_bytes": ("gauge", "Cached + Buffers: file pages held in the pool."),
    "glm53_unified_memory_swap_used_bytes": ("gauge", "SwapTotal - SwapFree."),
    "glm53_gpu_temperature_celsius": ("gauge", "GPU temperature from nvidia-smi (absent when not reported)."),
    "glm53_gpu_clock_hertz": ("gauge", "GPU clocks from nvidia-smi by clock domain (absent when not reported)."),
    "glm53_gpu_power_watts": ("gauge", "GPU power draw from nvidia-smi (absent when not reported)."),
    "glm53_gpu_utilization_ratio": ("gauge", "GPU utilisation from nvidia-smi, 0..1 (absent when not reported)."),
    "glm53_soc_temperature_celsius": ("gauge", "SoC thermal zones from /sys/class/thermal (absent when none are readable)."),
    "glm53_rank_container_running": ("gauge", "1 when this node's rank container runs; 0 when it stopped or does not exist."),
    "glm53_rank_container_exit_code": ("gauge", "Exit code of the stopped rank container (absent while it runs or when it does not exist)."),
    "glm53_rank_container_restarts": ("gauge", "Docker's restart count of the rank container."),
    "glm53_rank_container_started_timestamp_seconds": ("gauge", "When the rank container last started (Unix time)."),
    "glm53_canary_success": ("gauge", "1 when the last canary chat completion returned tokens, else 0 (head only)."),
    "glm53_canary_duration_seconds": ("gauge", "Wall time of the last canary request (head only)."),
    "glm53_canary_last_run_timestamp_seconds": ("gauge", "When the last canary ran (Unix time, head only)."),
    "glm53_collector_last_run_timestamp_seconds": ("gauge", "When this collector last wrote its file (Unix time)."),
    "glm53_collector_source_ok": ("gauge", "1 when a source (meminfo, docker, nvidia_smi, thermal) was read on the last pass."),
}

# Hardware readings: a CPU simulation (no nvidia-smi, no thermal zones) never has them, so a live check of the
# dashboard allows their absence.
HARDWARE_METRICS = frozenset({
    "glm53_gpu_temperature_celsius", "glm53_gpu_clock_hertz", "glm53_gpu_power_watts", "glm53_gpu_utilization_ratio",
    "glm53_soc_temperature_celsius",
})

# nvidia-smi --query-gpu fields -> (metric, extra labels, factor to base units)
NVIDIA_SMI_FIELDS: list[tuple[str, str, dict[str, str], float]] = [
    ("temperature.gpu", "glm53_gpu_temperature_celsius", {}, 1.0),
    ("clocks.gr", "glm53_gpu_clock_hertz", {"clock": "graphics"}, 1e6),
    ("clocks.sm", "glm53_gpu_clock_hertz", {"clock": "sm"}, 1e6),
    ("clocks.mem", "glm53_gpu_clock_hertz", {"clock": "memory"}, 1e6),
    ("power.draw", "glm53_gpu_power_watts", {}, 1.0),
    ("utilization.gpu", "glm53_gpu_utilization_ratio", {}, 0.01),
]


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes per field ("MemTotal: 131072 kB" -> {"MemTotal": 134217728})."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _colon, rest = line.partition(":")
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        fields[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return fields


def memory_samples(meminfo: dict[str, int]) -> list[Sample]:
    required = ("MemTotal", "MemFree", "MemAvailable")
    missing = [key for key in required if key not in meminfo]
    if missing:
        raise ValueError(f"/proc/meminfo lacks {', '.join(missing)}")
    samples = [
        Sample("glm53_unified_memory_total_bytes", meminfo["MemTotal"]),
        Sample("glm53_unified_memory_free_bytes", meminfo["MemFree"]),
        Sample("glm53_unified_memory_available_bytes", meminfo["MemAvailable"]),
        Sample("glm53_unified_memory_page_cache_bytes", meminfo.get("Cached", 0) + meminfo.get("Buffers", 0)),
    ]
    if "SwapTotal" in meminfo and "SwapFree" in meminfo:
        samples.append(Sample("glm53_unified_memory_swap_used_bytes", meminfo["SwapTotal"] - meminfo["SwapFree"]))
    return samples


def nvidia_smi_query() -> list[str]:
    return ["--query-gpu=index," + ",".join(f[0] for f in NVIDIA_SMI_FIELDS), "--format=csv,noheader,nounits"]


def _number(text: str) -> float | None:
    """A reading, or None for what nvidia-smi writes when it has none ("[N/A]", "[Not Supported]", "N/A")."""
    try:
        return float(text.strip())
    except ValueError:
        return None


def gpu_samples(csv_text: str) -> list[Sample]:
    """Rows of `nvidia-smi --query-gpu=index,<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits`."""
    samples: list[Sample] = []
    for row in csv_text.strip().splitlines():
        cells = [cell.strip() for cell in row.split(",")]
        if len(cells) != len(NVIDIA_SMI_FIELDS) + 1:
            raise ValueError(f"nvidia-smi row has {len(cells)} fields, expected {len(NVIDIA_SMI_FIELDS) + 1}: {row!r}")
        for (_field, metric, labels, factor), cell in zip(NVIDIA_SMI_FIELDS, cells[1:]):
            value = _number(cell)
            if value is not None:
                samples.append(Sample(metric, value * factor, {"gpu": cells[0], **labels}))
    return samples


def thermal_samples(zones: Iterable[tuple[str, str]]) -> list[Sample]:
    """(type, temp in millidegrees) per thermal zone; unreadable or nonsensical readings are left out."""
    samples: list[Sample] = []
    seen: dict[str, int] = {}
    for zone_type, raw in zones:
        value = _number(raw)
        if value is None or value <= 0:
            continue
        # Several zones may share a type (e.g. one per CPU cluster): number the repeats.
        count = seen.get(zone_type, 0)
        seen[zone_type] = count + 1
        zone = zone_type if count == 0 else f"{zone_type}{count}"
        samples.append(Sample("glm53_soc_temperature_celsius", value / 1000.0, {"zone": zone}))
    return samples


def container_samples(name: str, inspect: dict | None) -> list[Sample]:
    """A rank container from `GET /containers/<name>/json` (None: it does not exist, which counts as down).

    No rank label: Prometheus' scrape target carries node and rank, and a second one would arrive as exported_rank.
    """
    labels = {"container": name}
    if inspect is None:
        return [Sample("glm53_rank_container_running", 0, labels)]
    state = inspect.get("State", {})
    running = bool(state.get("Running"))
    samples = [
        Sample("glm53_rank_container_running", 1 if running else 0, labels),
        Sample("glm53_rank_container_restarts", float(inspect.get("RestartCount", 0)), labels),
    ]
    if not running:
        samples.append(Sample("glm53_rank_container_exit_code", float(state.get("ExitCode", 0)), labels))
    started = _docker_time(state.get("StartedAt", ""))
    if started is not None:
        samples.append(Sample("glm53_rank_container_started_timestamp_seconds", started, labels))
    return samples


def _docker_time(text: str) -> float | None:
    """Docker's RFC 3339 time with nanoseconds ("2026-12-01T10:00:00.123456789Z"); None for its zero time."""
    if not text or text.startswith("0001-"):
        return None
    base, _dot, frac = text.rstrip("Z").partition(".")
    try:
        moment = datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    return moment.timestamp() + (float("0." + frac[:9]) if frac.isdigit() else 0.0)


def canary_samples(ok: bool, duration_s: float, at: float) -> list[Sample]:
    return [
        Sample("glm53_canary_success", 1 if ok else 0),
        Sample("glm53_canary_duration_seconds", duration_s),
        Sample("glm53_canary_last_run_timestamp_seconds", at),
    ]


def canary_ok(status: int, body: bytes) -> bool:
    """The canary passes when the server answered 200 with at least one completion token."""
    if status != 200:
        return False
    try:
        usage = json.loads(body).get("usage") or {}
    except (ValueError, AttributeError):
        return False
    return int(usage.get("completion_tokens") or 0) > 0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(samples: Iterable[Sample]) -> str:
    """Prometheus text exposition, one HELP/TYPE block per metric, families in METRICS order."""
    by_name: dict[str, list[Sample]] = {}
    for sample in samples:
        if sample.name not in METRICS:
            raise KeyError(f"{sample.name} is not declared in METRICS")
        by_name.setdefault(sample.name, []).append(sample)
    lines: list[str] = []
    for name in METRICS:
        if name not in by_name:
            continue
        kind, help_text = METRICS[name]
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for sample in by_name[name]:
            labels = ",".join(f'{key}="{_escape(val)}"' for key, val in sorted(sample.labels.items()))
            lines.append(f"{name}{{{labels}}} {sample.value:.17g}" if labels else f"{name} {sample.value:.17g}")
    return "\n".join(lines) + "\n"


def write_atomic(directory: Path, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".glm53.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        # node-exporter runs as nobody; mkstemp makes the file 0600.
        os.chmod(tmp, 0o644)
        os.replace(tmp, directory / OUTPUT_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def docker_inspect(socket_path: str, name: str, timeout: float = 5.0) -> dict | None:
    conn = _UnixHTTPConnection(socket_path, timeout)
    try:
        conn.request("GET", f"/containers/{name}/json")
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status == 404:
        return None
    if response.status != 200:
        raise RuntimeError(f"docker API answered {response.status} for {name}: {body[:200]!r}")
    return json.loads(body)


def read_thermal_zones(root: Path) -> list[tuple[str, str]]:
    zones = []
    for zone in sorted(root.glob("thermal_zone*")):
        try:
            zones.append(((zone / "type").read_text().strip(), (zone / "temp").read_text().strip()))
        except OSError:
            continue
    return zones


def run_canary(url: str, model: str, prompt: str, max_tokens: int, api_key: str, timeout: float) -> tuple[bool, float]:
    payload = json.dumps({"model": model, "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": prompt}]}).encode()
    request = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=payload, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            ok = canary_ok(response.status, response.read())
    except (urllib.error.URLError, OSError, ValueError):
        ok = False
    return ok, time.monotonic() - start


@dataclass
class Collector:
    args: argparse.Namespace
    clock: Callable[[], float] = time.time
    _canary: list[Sample] = field(default_factory=list)
    _canary_at: float = 0.0

    def _source(self, name: str, read: Callable[[], list[Sample]], out: list[Sample]) -> None:
        try:
            out.extend(read())
            ok = 1
        except Exception as exc:  # noqa: BLE001 - one unreadable source must not silence the others
            print(f"glm53-collector: {name}: {exc}", file=sys.stderr)
            ok = 0
        out.append(Sample("glm53_collector_source_ok", ok, {"source": name}))

    def collect(self) -> list[Sample]:
        args = self.args
        samples: list[Sample] = []
        self._source("meminfo", lambda: memory_samples(parse_meminfo(Path(args.meminfo).read_text())), samples)
        if args.container:
            self._source("docker", lambda: [s for name in args.container
                                            for s in container_samples(name, docker_inspect(args.docker_socket, name))],
                         samples)
        if args.nvidia_smi:
            self._source("nvidia_smi", lambda: gpu_samples(subprocess.run(
                [args.nvidia_smi, *nvidia_smi_query()], check=True, capture_output=True, text=True, timeout=20).stdout),
                samples)
        thermal = thermal_samples(read_thermal_zones(Path(args.thermal_root)))
        samples.extend(thermal)
        if args.canary_url and self.clock() - self._canary_at >= args.canary_interval:
            ok, duration = run_canary(args.canary_url, args.canary_model, args.canary_prompt, args.canary_max_tokens,
                                      os.environ.get(args.canary_api_key_env, ""), args.canary_timeout)
            self._canary_at = self.clock()
            self._canary = canary_samples(ok, duration, self._canary_at)
        samples.extend(self._canary)
        samples.append(Sample("glm53_collector_last_run_timestamp_seconds", self.clock()))
        return samples


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="node-exporter's textfile directory")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between passes")
    parser.add_argument("--once", action="store_true", help="one pass, then exit")
    parser.add_argument("--meminfo", default="/proc/meminfo")
    parser.add_argument("--thermal-root", default="/sys/class/thermal")
    parser.add_argument("--container", action="append", default=[], metavar="NAME",
                        help="rank container to report (repeatable)")
    parser.add_argument("--docker-socket", default="/var/run/docker.sock")
    parser.add_argument("--nvidia-smi", default="", help="nvidia-smi to query; empty on nodes without a GPU")
    parser.add_argument("--canary-url", default="", help="the head's API base URL; empty disables the canary")
    parser.add_argument("--canary-model", default="")
    parser.add_argument("--canary-prompt", default="Reply with one word.")
    parser.add_argument("--canary-max-tokens", type=int, default=4)
    parser.add_argument("--canary-interval", type=float, default=60.0)
    parser.add_argument("--canary-timeout", type=float, default=30.0)
    parser.add_argument("--canary-api-key-env", default="GLM53_API_KEY",
                        help="environment variable holding the API key (never on the command line)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    collector = Collector(args)
    while True:
        write_atomic(Path(args.out), render(collector.collect()))
        if args.once:
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
