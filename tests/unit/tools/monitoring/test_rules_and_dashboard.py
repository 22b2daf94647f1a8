"""The alert rules, their promtool tests and the dashboard agree with each other and with what is scraped."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from tools.monitoring.dashboard_queries import dashboard_metrics, metric_names, missing_metrics
from tools.monitoring.render import EXAMPLE_CLUSTER, monitoring_defaults, render_all

REPO = Path(__file__).resolve().parents[4]
DASHBOARD = json.loads((REPO / "roles/monitoring/files/dashboards/glm53.json").read_text())
PROMTOOL_TESTS = sorted((REPO / "tests/monitoring").glob("*.test.yml"))
_spec = importlib.util.spec_from_file_location("glm53_node_collector", REPO / "roles/monitoring/files/glm53_node_collector.py")
collector = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = collector
_spec.loader.exec_module(collector)

# Series Prometheus makes itself, and the node-exporter metrics the dashboard reads.
PROMETHEUS_BUILTIN = {"up", "ALERTS"}
NODE_EXPORTER = {"node_cpu_seconds_total"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    values = {**monitoring_defaults(), **EXAMPLE_CLUSTER}
    return {name: yaml.safe_load(text) for name, text in render_all(values).items()}


def _rules(rendered: dict[str, dict]) -> list[dict]:
    return [rule for name, doc in rendered.items() if name.startswith("rules/")
            for group in doc["groups"] for rule in group["rules"]]


def _vllm_metric_names() -> set[str]:
    """Every vllm:* metric vLLM (the installed 0.32) declares, with the suffixes its client library adds."""
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    names: set[str] = set()
    for path in (root / "v1").rglob("*.py"):
        names.update(re.findall(r'"(vllm:[a-z_]+)"', path.read_text()))
    return {name + suffix for name in names for suffix in ("", "_total", "_bucket", "_sum", "_count")}


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (model_name, le) (rate(vllm:ttft_bucket{le="+Inf", job=~"a.*"}[5m]))', {"vllm:ttft_bucket"}),
    ("1 + glm53:a:rate5m / on (node) group_left (rank) b offset 5m", {"glm53:a:rate5m", "b"}),
    ("histogram_quantile(0.9, x[$__rate_interval]) > 1e6 and y_total > bool 2", {"x", "y_total"}),
    ('up{job=~"glm53-.*"} == 0', {"up"}),
])
def test_metric_names_of_an_expression(expr, names):
    assert metric_names(expr) == names


def test_every_alert_has_a_promtool_test_that_expects_it_to_fire(rendered):
    alerts = {rule["alert"] for rule in _rules(rendered) if "alert" in rule}
    firing: set[str] = set()
    for path in PROMTOOL_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            firing.update(t["alertname"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts"))
    assert alerts, "no alert rules rendered"
    assert alerts - firing == set(), "alerts without a promtool test that expects them to fire"


def test_promtool_tests_read_the_rendered_rule_files(rendered):
    for path in PROMTOOL_TESTS:
        for rule_file in yaml.safe_load(path.read_text())["rule_files"]:
            assert rule_file.startswith("../../build/monitoring/rules/")
            assert "rules/" + Path(rule_file).name in rendered, f"{path.name} reads {rule_file}, which nothing renders"


def _router_metric_names() -> set[str]:
    """Every vllm_router_* metric the installed vllm-router (0.1.17, the engine image's pin) names in its binary."""
    root = Path(importlib.util.find_spec("vllm_router").submodule_search_locations[0]).parent
    binary = next(root.glob("vllm_router_rs*.so")).read_bytes()
    return {name.decode() for name in re.findall(rb"vllm_router_[a-z_]+[a-z]", binary)}


def test_rules_read_only_metrics_that_vllm_and_the_collector_export(rendered):
    recorded = {rule["record"] for rule in _rules(rendered) if "record" in rule}
    known = _vllm_metric_names() | set(collector.METRICS) | recorded | PROMETHEUS_BUILTIN
    used = {name for rule in _rules(rendered) for name in metric_names(str(rule["expr"]))}
    assert used - known == set()


def test_every_dashboard_query_names_a_metric_the_exporters_or_rules_produce(rendered):
    recorded = {rule["record"] for rule in _rules(rendered) if "record" in rule}
    produced = (_vllm_metric_names() | _router_metric_names() | set(collector.METRICS) | recorded | PROMETHEUS_BUILTIN
                | NODE_EXPORTER)
    assert missing_metrics(DASHBOARD, produced) == {}
    # And it draws what the issue asks for.
    used = dashboard_metrics(DASHBOARD)
    for wanted in ("glm53:generation_tokens:rate1m", "glm53:request_decode_tokens_per_second:quantile_rate5m",
                   "glm53:time_to_first_token_seconds:quantile_rate5m", "glm53:inter_token_latency_seconds:quantile_rate5m",
                   "glm53:spec_decode_acceptance:ratio_rate5m", "glm53:spec_decode_accepted_tokens_per_draft:rate5m",
                   "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                   "glm53_unified_memory_available_bytes", "glm53_rank_container_running"):
        assert wanted in used


def test_every_panel_reads_the_chosen_data_source():
    variables = {v["name"] for v in DASHBOARD["templating"]["list"] if v["type"] == "datasource"}
    assert variables == {"datasource"}

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))
    queried = [p for p in panels(DASHBOARD["panels"]) if p.get("targets")]
    assert queried
    for panel in queried:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    assert len({p["id"] for p in panels(DASHBOARD["panels"])}) == len(list(panels(DASHBOARD["panels"])))


def test_prometheus_config_scrapes_the_engine_and_every_node(rendered):
    config = rendered["prometheus.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["glm53-vllm"]["static_configs"][0]["targets"] == ["10.0.0.1:8888"]
    node_targets = [c["targets"][0] for c in jobs["glm53-node"]["static_configs"]]
    assert node_targets == ["10.0.0.1:9100", "10.0.0.2:9100"]
    assert config["global"]["scrape_interval"] == f"{monitoring_defaults()['glm53_monitoring_scrape_interval']}s"


def test_the_first_replica_groups_stack_scrapes_the_router_and_every_group(rendered):
    jobs = {job["job_name"]: job for job in rendered["prometheus.yml"]["scrape_configs"]}
    assert jobs["glm53-router"]["file_sd_configs"] == [{"files": ["/etc/prometheus/targets/router.json"]}]
    assert jobs["glm53-groups"]["file_sd_configs"] == [{"files": ["/etc/prometheus/targets/groups.json"]}]
    # Only `up` of the groups is kept: the engine sums stay this group's (glm53-vllm).
    assert jobs["glm53-groups"]["metric_relabel_configs"] == [
        {"source_labels": ["__name__"], "regex": ".+", "action": "drop"}]
    # The router counts each group's requests; vllm_router_worker_health is declared, but 0.1.17 never sets it.
    assert "vllm_router_processed_requests_total" in _router_metric_names()
    without = yaml.safe_load(render_all({**monitoring_defaults(), **EXAMPLE_CLUSTER, "_monitoring_front": False})
                             ["prometheus.yml"])
    assert not {"glm53-router", "glm53-groups"} & {job["job_name"] for job in without["scrape_configs"]}
