# SPDX-License-Identifier: MIT
"""vLLM's router in front of replica groups (module_utils/router.py): the group URLs, the command line as vllm-router's
own parser (0.1.17, installed here) reads it, and a draining group's requests read from vLLM's metrics text."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ansible_collections.sparkops.glm53.plugins.module_utils.router import (
    api_url,
    group_scrape_targets,
    requests_in_flight,
    router_argv,
)
from vllm_router.launch_router import parse_router_args

REPO = Path(__file__).resolve().parents[4]
SPEC = yaml.safe_load((REPO / "roles/glm53/meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]


def default(name: str) -> object:
    return SPEC[name]["default"]


def test_a_head_listening_on_every_address_is_reached_at_its_fabric_address() -> None:
    assert api_url("0.0.0.0", "10.0.0.3", 8000) == "http://10.0.0.3:8000"
    assert api_url("", "10.0.0.3", "8000") == "http://10.0.0.3:8000"
    assert api_url("::", "10.0.0.3", 8000) == "http://10.0.0.3:8000"


def test_a_head_bound_to_one_address_is_reached_there_and_ipv6_is_bracketed() -> None:
    assert api_url("192.168.1.11", "10.0.0.1", 8000) == "http://192.168.1.11:8000"
    assert api_url("fd00::11", "10.0.0.1", 8000) == "http://[fd00::11]:8000"


def settings(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "bind": "0.0.0.0", "port": default("glm53_router_port"),
        "workers": ["http://10.0.0.1:8000", "http://10.0.0.3:8000"],
        "policy": default("glm53_router_policy"), "health_interval": default("glm53_router_health_interval"),
        "health_failures": default("glm53_router_health_failures"),
        "metrics_port": default("glm53_router_metrics_port"), "api_key": "group-key",
    }
    base.update(changes)
    return base


def test_vllm_routers_parser_reads_the_command_line_as_meant() -> None:
    args = parse_router_args(router_argv(**settings()))  # type: ignore[arg-type]
    assert args.worker_urls == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert (args.host, args.port, args.policy) == ("0.0.0.0", 8100, "cache_aware")
    assert args.health_check_endpoint == "/health"
    assert (args.health_check_interval_secs, args.health_failure_threshold, args.health_success_threshold) == (2, 2, 1)
    assert (args.prometheus_host, args.prometheus_port) == ("0.0.0.0", 29100)
    assert args.api_key == "group-key"
    # It must not give up on a group that is still loading when it starts.
    assert args.worker_startup_timeout_secs >= 600
    # A group the health checks call healthy takes requests: no second rotation behind /workers.
    assert args.disable_circuit_breaker


@pytest.mark.parametrize("policy", SPEC["glm53_router_policy"]["choices"])
def test_every_policy_the_setting_allows_is_one_vllm_router_knows(policy: str) -> None:
    assert parse_router_args(router_argv(**settings(policy=policy))).policy == policy  # type: ignore[arg-type]


def test_without_a_key_no_key_is_sent_and_without_groups_nothing_is_started() -> None:
    assert parse_router_args(router_argv(**settings(api_key=""))).api_key is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one group API"):
        router_argv(**settings(workers=[]))  # type: ignore[arg-type]


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="glm"} %s
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="glm"} %s
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="glm"} 41.0
"""


def test_a_group_is_drained_when_nothing_runs_or_waits() -> None:
    assert requests_in_flight(METRICS % ("0.0", "0.0")) == 0
    assert requests_in_flight(METRICS % ("2.0", "0.0")) == 2
    assert requests_in_flight(METRICS % ("1.0", "3.0")) == 4


def test_the_router_pin_is_the_same_everywhere() -> None:
    pins = {
        "requirements-dev.txt": re.findall(r"^vllm-router==(\S+)$", (REPO / "requirements-dev.txt").read_text(), re.M),
        "docker/Dockerfile": re.findall(r"^ARG ROUTER_SPEC=vllm-router==(\S+)$",
                                        (REPO / "docker/Dockerfile").read_text(), re.M),
        "docker/sim/vllm-cpu.Dockerfile": re.findall(r"^ARG ROUTER_SPEC=vllm-router==(\S+)$",
                                                     (REPO / "docker/sim/vllm-cpu.Dockerfile").read_text(), re.M),
    }
    assert all(len(found) == 1 for found in pins.values()), pins
    assert len({found[0] for found in pins.values()}) == 1, pins


def test_each_group_is_a_scrape_target_labelled_with_its_name() -> None:
    assert group_scrape_targets(["http://10.0.0.1:8888", "http://[fd00::3]:8888"], ["a", "b"]) == [
        {"targets": ["10.0.0.1:8888"], "labels": {"group": "a"}},
        {"targets": ["[fd00::3]:8888"], "labels": {"group": "b"}}]
    with pytest.raises(ValueError, match="2 group APIs for 1 group names"):
        group_scrape_targets(["http://10.0.0.1:8888", "http://10.0.0.3:8888"], ["a"])
