"""Every setting is checked for type, range and meaning on every run, features on or off, and the serve
check reports each setting's own rule and the rules between settings."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.sparkops.glm53.plugins.module_utils.settings_rules import serve_settings_errors, settings_errors

REPO = Path(__file__).resolve().parents[4]
SPEC = yaml.safe_load((REPO / "roles/glm53/meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
DEFAULTS = yaml.safe_load((REPO / "roles/glm53/defaults/main.yml").read_text())
# The serve settings as the role hands them to the renderer: no prefix, sizes resolved, checkpoints found.
SERVE = {**{name.removeprefix("glm53_"): value for name, value in DEFAULTS.items()},
         "model": "/checkpoint", "draft_model": "/draft", "tensor_parallel_size": 2}


def errors_for(**changes: Any) -> list[str]:
    return settings_errors({**DEFAULTS, **changes}, SPEC)


def test_the_shipped_defaults_pass() -> None:
    assert errors_for() == []


@pytest.mark.parametrize(("name", "value", "allowed"), [
    # A disabled feature's value is still checked: it would fail the day the feature is switched on.
    ("glm53_ablation_alpha", 0.0, "> 0"),
    ("glm53_ablation_alpha", -1, "> 0"),
    ("glm53_ablation_layers", "15..45", "layer ranges"),
    ("glm53_dflash_tokens", 0, "in [1, 16]"),
    ("glm53_mtp_tokens", 0, "in [1, 8]"),
    ("glm53_served_model_name", "  ", "non-empty"),
    # Docker refuses these names at `docker run`, after the old ranks were already removed.
    ("glm53_container_prefix", "glm53 rank", "container name"),
    ("glm53_container_prefix", "-rank", "container name"),
    ("glm53_port", 0, "in [1, 65535]"),
    ("glm53_port", 70000, "in [1, 65535]"),
    ("glm53_gpu_memory_utilization", 0, "in (0, 1]"),
    ("glm53_gpu_memory_utilization", 1.2, "in (0, 1]"),
    ("glm53_model_repo", "no-slash", "repo id"),
    ("glm53_model_fallbacks", [{"repo": "a/b", "revision": "has space"}], "Hugging Face repos"),
    ("glm53_draft_revision", "", "branch, tag or commit"),
    ("glm53_hf_endpoint", "hub.local:8090", "http(s)"),
    ("glm53_hf_cache_dir", "relative/dir", "absolute path"),
    ("glm53_api_bind", "localhost:8888", "IP address"),
    ("glm53_shm_size", "32 GB", "docker size"),
    ("glm53_image", "", "image reference"),
    ("glm53_image_platform", "arm64", "platform"),
    ("glm53_limit_mm", {"image": -1}, "count >= 0"),
    ("glm53_engine_env", {"BAD NAME": "1"}, "environment variable"),
    ("glm53_kernel_config", {"enable flashinfer autotune": False}, "kernel-config field names"),
    ("glm53_kernel_config", {"enable_flashinfer_autotune": [False]}, "true/false, numbers or strings"),
    ("glm53_block_size", -1, ">= 0"),
    ("glm53_canary_max_tokens", 0, ">= 1"),
    # The health stage would raise re.error after the whole launch; refused before anything starts instead.
    ("glm53_canary_expect", "(?i)paris(", "regular expression that compiles (missing ), unterminated subpattern"),
    ("glm53_quality_repo", "tiny-glm-quality", "repo id, org/name or empty"),
    ("glm53_quality_revision", "", "branch, tag or commit"),
    ("glm53_quality_max_kld", -0.1, ">= 0"),
    ("glm53_quality_min_top1", 1.5, "in [0, 1]"),
    # Zero attempts would stop the group at its first hiccup; a zero poll would spin on the head's cores.
    ("glm53_self_heal_max_attempts", 0, ">= 1"),
    ("glm53_self_heal_poll_interval", 0, ">= 1"),
    ("glm53_self_heal_grace", -1, ">= 0"),
    ("glm53_ib_hca", "rocep1s0f1,rocep1s0f1", "each at most once"),
    ("glm53_ib_hca", ["rocep1s0f1:0"], "port >= 1"),
    ("glm53_ib_gid_index", -1, ">= 0"),
    ("glm53_kv_cache_memory_bytes", -5, ">= 0"),
    ("glm53_long_prefill_token_threshold", -1, ">= 0"),
    ("glm53_monitoring_down_for", "1 minute", "Prometheus duration"),
    ("glm53_monitoring_spec_acceptance_min", 1.5, "fraction"),
    ("glm53_grafana_url", "grafana:3000", "http(s)"),
    # The edge's keys and names go verbatim into nginx's config: a quote or a space would break out of it.
    ("glm53_edge_keys", {"alice": 'key-with-a-"quote"-inside'}, "keys of 16 to 256"),
    ("glm53_edge_keys", {"al ice": "a-long-enough-key-0001"}, "user names"),
    ("glm53_edge_keys", {"alice": "short"}, "keys of 16 to 256"),
    ("glm53_edge_keys", {"alice": "the-same-key-00001", "bob": "the-same-key-00001"}, "no key shared"),
    ("glm53_edge_port", 0, "in [1, 65535]"),
    ("glm53_edge_retry_after", 0, ">= 1"),
    ("glm53_edge_max_requests", -1, ">= 0"),
    ("glm53_router_port", 70000, "in [1, 65535]"),
    ("glm53_router_bind", "not-an-address", "address"),
    ("glm53_router_health_interval", 0, "in [1, 60]"),
    ("glm53_router_health_failures", 11, "in [1, 10]"),
    ("glm53_router_drain_timeout", -1, "in [0, 3600]"),
    ("glm53_router_policy", "least_busy", "cache_aware, round_robin"),
])
def test_a_value_that_cannot_be_right_names_the_setting_and_what_is_allowed(
        name: str, value: Any, allowed: str) -> None:
    errors = errors_for(**{name: value})
    assert len(errors) == 1, errors
    assert errors[0].startswith(name) and allowed in errors[0]


@pytest.mark.parametrize("pins", [None, "rocep1s0f1", "rocep1s0f1,roceP2p1s0f1", ["mlx5_0:1", "mlx5_1:1"]])
def test_dual_rail_pins_in_every_accepted_form_pass(pins: Any) -> None:
    assert errors_for(glm53_ib_hca=pins) == []


def test_types_come_from_the_spec_and_strings_from_the_command_line_convert() -> None:
    assert errors_for(glm53_port="8080", glm53_enforce_eager="yes", glm53_ablation_alpha="1.5") == []
    [error] = errors_for(glm53_port="eighty")
    assert error.startswith("glm53_port:") and "int" in error


def test_choices_come_from_the_spec() -> None:
    [error] = errors_for(glm53_spec_method="eagle")
    assert error == "glm53_spec_method must be one of dflash, mtp, none (got 'eagle')"


def test_every_bad_setting_is_reported_at_once() -> None:
    errors = errors_for(glm53_port=0, glm53_ablation_alpha=0, glm53_container_prefix="a b")
    assert [e.split()[0] for e in errors] == ["glm53_port", "glm53_container_prefix", "glm53_ablation_alpha"]


def test_unknown_names_and_unset_per_host_pins_are_ignored() -> None:
    assert settings_errors({"glm53_not_a_setting": object(), "glm53_ib_gid_index": None}, SPEC) == []


def serve_errors_for(**changes: Any) -> list[str]:
    return serve_settings_errors({**SERVE, **changes}, SPEC)


def test_the_shipped_serve_settings_pass() -> None:
    assert serve_errors_for() == []


@pytest.mark.parametrize(("changes", "message"), [
    # Each setting's own rule: every one the serve filters reported when serve_argv kept copies of them.
    ({"gpu_memory_utilization": 0}, "glm53_gpu_memory_utilization must be in (0, 1] (got 0)"),
    ({"gpu_memory_utilization": "lots"}, "glm53_gpu_memory_utilization: could not convert"),
    ({"port": 70000}, "glm53_port must be in [1, 65535] (got 70000)"),
    ({"master_port": 0}, "glm53_master_port must be in [1, 65535] (got 0)"),
    ({"master_port": "x"}, "glm53_master_port: 'x' is not an integer"),
    ({"max_model_len": 0}, "glm53_max_model_len must be >= 1 (got 0)"),
    ({"max_model_len": -5}, "glm53_max_model_len must be >= 1 (got -5)"),
    ({"kv_cache_memory_bytes": -1}, "glm53_kv_cache_memory_bytes must be >= 0 (got -1)"),
    ({"max_num_seqs": 0}, "glm53_max_num_seqs must be >= 1 (got 0)"),
    ({"max_num_batched_tokens": 0}, "glm53_max_num_batched_tokens must be >= 1 (got 0)"),
    ({"long_prefill_token_threshold": -1}, "glm53_long_prefill_token_threshold must be >= 0 (got -1)"),
    ({"pipeline_parallel_size": 0}, "glm53_pipeline_parallel_size must be >= 1 (got 0)"),
    ({"spec_method": "eagle3"}, "glm53_spec_method must be one of dflash, mtp, none (got 'eagle3')"),
    ({"kv_cache_dtype": "nvfp4"}, "glm53_kv_cache_dtype must be one of auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2, "
                                  "fp8_ds_mla (got 'nvfp4')"),
    ({"dflash_tokens": 0}, "glm53_dflash_tokens must be in [1, 16] (got 0)"),
    ({"spec_method": "mtp", "mtp_tokens": 0}, "glm53_mtp_tokens must be in [1, 8] (got 0)"),
    ({"enable_prefix_caching": "maybe"}, "glm53_enable_prefix_caching: 'maybe' is not a boolean"),
    ({"limit_mm": "image=4"}, "glm53_limit_mm: 'image=4' is not a mapping"),
    ({"extra_serve_args": "--foo bar"}, "glm53_extra_serve_args: '--foo bar' is not a list"),
    ({"extra_serve_args": ["--foo", 1]}, "glm53_extra_serve_args must be a list of strings"),
    ({"served_model_name": 5}, "glm53_served_model_name: 5 is not a string"),
    ({"port": True}, "glm53_port: a boolean is not a number"),
    # The rules between settings, and what the renderer cannot do without.
    ({"master_port": 8888}, "glm53_port and glm53_master_port must differ"),
    ({"tensor_parallel_size": 3}, "glm53_tensor_parallel_size must be a divisor of the model's 64 attention heads"),
    ({"dflash_tokens": None}, "glm53_dflash_tokens is required when glm53_spec_method is dflash"),
    ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "glm53_max_num_batched_tokens (4) must be >= "),
    ({"long_prefill_token_threshold": 4096, "max_model_len": 2048}, "glm53_long_prefill_token_threshold (4096) must"),
    ({"model": ""}, "glm53_model is required"),
])
def test_the_serve_check_reports_each_settings_own_rule_and_the_rules_between_them(
        changes: dict[str, Any], message: str) -> None:
    errors = serve_errors_for(**changes)
    assert any(e.startswith(message) for e in errors), errors


def test_a_setting_refused_on_its_own_is_not_reported_again_by_a_rule_between_settings() -> None:
    assert sorted(serve_errors_for(port=0, master_port=0)) == [
        "glm53_master_port must be in [1, 65535] (got 0)", "glm53_port must be in [1, 65535] (got 0)"]


def test_a_refused_key_is_never_shown() -> None:
    errors = errors_for(glm53_edge_keys={"alice": "secret key with spaces"})
    assert errors and not any("secret key" in error for error in errors), errors


@pytest.mark.parametrize(("changes", "expected"), [
    ({"glm53_edge": True}, "glm53_edge_keys must name at least one user and key when glm53_edge is on"),
    ({"glm53_edge_port": 8888}, "glm53_edge_port (8888) must differ from glm53_port"),
    ({"glm53_edge_max_requests_per_key": 9, "glm53_edge_max_requests": 3},
     "glm53_edge_max_requests_per_key (9) must be <= glm53_edge_max_requests (3)"),
    ({"glm53_edge_tls_cert": "/etc/edge/cert.pem"},
     "glm53_edge_tls_cert and glm53_edge_tls_key must be set together (or both left empty)"),
    ({"glm53_edge_tls_local_ca": True, "glm53_edge_tls_cert": "/c.pem", "glm53_edge_tls_key": "/k.pem"},
     "glm53_edge_tls_local_ca and glm53_edge_tls_cert are two ways to the edge's certificate: set one"),
])
def test_the_edges_settings_must_agree(changes: dict[str, Any], expected: str) -> None:
    assert errors_for(**changes) == [expected]


def test_an_edge_with_keys_and_derived_limits_passes() -> None:
    assert errors_for(glm53_edge=True, glm53_edge_keys={"alice": "a-long-enough-key-0001"},
                      glm53_edge_max_requests_per_key=0, glm53_edge_max_requests=0) == []


@pytest.mark.parametrize(("changes", "expected"), [
    ({"glm53_ablation_enabled": True},
     "glm53_ablation_direction must be set when glm53_ablation_enabled is true and glm53_ablation_method is proj"
     " (the path on the controller of the direction file)"),
    ({"glm53_ablation_enabled": "true", "glm53_ablation_method": "transplant", "glm53_ablation_direction": "/d.pt"},
     "glm53_ablation_donor_dir must be set when glm53_ablation_enabled is true and glm53_ablation_method is"
     " transplant (the path on every node of the donor directory)"),
])
def test_an_ablation_method_without_its_input_is_refused(changes: dict[str, Any], expected: str) -> None:
    assert errors_for(**changes) == [expected]


def test_preflight_says_a_rule_once_when_the_serve_check_applies_it_too() -> None:
    # As roles/preflight/vars/main.yml combines them: every setting's own check, with the serve check's errors.
    changes = {"glm53_ablation_enabled": True}
    serve = serve_errors_for(**{name.removeprefix("glm53_"): value for name, value in changes.items()})
    assert len(serve) == 1
    assert settings_errors({**DEFAULTS, **changes}, SPEC, also=serve) == serve


@pytest.mark.parametrize("changes", [
    {"glm53_ablation_enabled": True, "glm53_ablation_direction": "/home/me/direction.pt"},
    {"glm53_ablation_enabled": True, "glm53_ablation_method": "transplant", "glm53_ablation_donor_dir": "/donor"},
    {"glm53_ablation_enabled": False, "glm53_ablation_method": "transplant"},
])
def test_an_ablation_with_its_input_or_turned_off_passes(changes: dict[str, Any]) -> None:
    assert errors_for(**changes) == []


@pytest.mark.parametrize(("changes", "expected"), [
    ({"glm53_router_port": 8888}, "glm53_router_port (8888) must differ from glm53_port"),
    ({"glm53_router_port": 8443}, "glm53_router_port (8443) must differ from glm53_edge_port"),
    ({"glm53_router_port": 29100}, "glm53_router_port (29100) must differ from glm53_router_metrics_port"),
    ({"glm53_router_metrics_port": 8888}, "glm53_router_metrics_port (8888) must differ from glm53_port"),
])
def test_the_routers_ports_must_differ_from_the_others(changes: dict[str, Any], expected: str) -> None:
    assert errors_for(**changes) == [expected]
