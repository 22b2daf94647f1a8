# SPDX-License-Identifier: MIT
"""What every setting may hold beyond its type: ranges, formats and meaning.

Ansible's argument spec (roles/glm53/meta/argument_specs.yml, the source of every setting's type, default and
choices) checks types and choices when the role starts; its schema has no room for ranges or formats, so they
live here, in one table keyed by setting name, and nowhere else. `settings_errors` applies the spec's types and
choices and this table to every setting on every run, whether or not the feature that uses it is on: a bad
value in a disabled feature is still a bad value, and it would otherwise surface only the day someone turns
the feature on. The rules between settings of the serve command (dflash needs a draft, ...) are
serve_argv.validate_settings'; `serve_settings_errors` runs both, so no caller gets one without the other.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ansible_collections.sparkops.glm53.plugins.module_utils.serve_argv import (
    as_bool,
    as_float,
    as_int,
    as_str,
    validate_settings,
    var,
)

# A check returns None when the (already type-converted) value is fine, else what is allowed.
Check = Callable[[Any], "str | None"]

_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# Docker's own container-name rule: refused names fail at `docker run`, after the old ranks are gone.
_DOCKER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$")
_DOCKER_SIZE = re.compile(r"^[0-9]+[bkmgBKMG]?$")
_IMAGE_REF = re.compile(r"^[a-z0-9][a-z0-9._/:@-]*[a-zA-Z0-9_]$")
_PLATFORM = re.compile(r"^[a-z0-9]+/[a-z0-9_]+(/[a-z0-9]+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HCA = re.compile(r"^[A-Za-z0-9_.-]+(:[1-9][0-9]*)?$")
# Prometheus durations: 30s, 1m, 1h30m, 15d.
_PROM_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
# The edge's keys and names go verbatim into nginx's config: no quote, space or semicolon can reach it.
_EDGE_USER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_EDGE_KEY = re.compile(r"^[A-Za-z0-9._~+/=-]{16,256}$")
_LAYERS = re.compile(r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$")


def at_least(low: float) -> Check:
    return lambda v: None if v >= low else f">= {low:g}"


def between(low: float, high: float, *, low_open: bool = False) -> Check:
    def check(v: float) -> str | None:
        ok = (v > low if low_open else v >= low) and v <= high
        return None if ok else f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    return check


def matches(pattern: re.Pattern[str], what: str, *, empty_ok: bool = False) -> Check:
    def check(v: str) -> str | None:
        if v == "" and empty_ok:
            return None
        return None if pattern.match(v) else what + (" or empty" if empty_ok else "")
    return check


def positive(v: float) -> str | None:
    return None if 0 < v < float("inf") else "> 0"


def nonempty(v: str) -> str | None:
    return None if v.strip() else "a non-empty string"


def absolute_path_or_empty(v: str) -> str | None:
    return None if v == "" or v.startswith("/") else "an absolute path, or empty for the default"


def url_or_empty(v: str) -> str | None:
    return None if v == "" or re.match(r"^https?://[^\s/]+", v) else "an http(s):// URL, or empty"


def address_or_empty(v: str) -> str | None:
    if v == "":
        return None
    try:
        ipaddress.ip_address(v)
    except ValueError:
        return "an IP address to listen on, or empty for every address"
    return None


def revision(v: str) -> str | None:
    return None if v and not re.search(r"\s", v) else "a branch, tag or commit sha without spaces"


def repo_list(v: list[Any]) -> str | None:
    """Fallback repos: `org/name` strings or {repo, revision} mappings (a revision belongs to one repo)."""
    for item in v:
        repo = item.get("repo") if isinstance(item, Mapping) else item
        rev = item.get("revision", "main") if isinstance(item, Mapping) else "main"
        if not isinstance(repo, str) or not _HF_REPO.match(repo) or not isinstance(rev, str) or revision(rev):
            return "a list of Hugging Face repos (org/name, or {repo: org/name, revision: sha})"
    return None


def mm_limits(v: Mapping[str, Any]) -> str | None:
    ok = all(isinstance(k, str) and not isinstance(n, bool) and isinstance(n, int) and n >= 0 for k, n in v.items())
    return None if ok else "a mapping of modality to a count >= 0, such as {image: 4, video: 1}"


def kernel_config(v: Mapping[str, Any]) -> str | None:
    # vLLM's KernelConfig fields are Python identifiers with JSON scalar values; the parser checks the names.
    if all(isinstance(k, str) and k.isidentifier() and (v[k] is None or isinstance(v[k], (bool, int, float, str)))
           for k in v):
        return None
    return "a mapping of vLLM kernel-config field names to true/false, numbers or strings"


def env_mapping(v: Mapping[str, Any]) -> str | None:
    ok = all(isinstance(k, str) and _ENV_NAME.match(k) and isinstance(x, (str, int, float)) for k, x in v.items())
    return None if ok else "a mapping of environment variable names to string values"


def string_list(v: list[Any]) -> str | None:
    return None if all(isinstance(x, str) for x in v) else "a list of strings"


def hca_pins(v: Any) -> str | None:
    """glm53_ib_hca: one RDMA device, a comma-separated string or a list; each NAME or NAME:PORT, none twice."""
    if v is None:
        return None
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        return "an RDMA device name, a comma-separated string or a list of names (NAME or NAME:PORT)"
    names = [i.strip() for i in items]
    if not names or any(not _HCA.match(n) for n in names) or len(set(names)) != len(names):
        return "RDMA device names (NAME or NAME:PORT with a port >= 1), each at most once"
    return None


def fraction(v: float) -> str | None:
    return None if 0 <= v <= 1 else "a fraction in [0, 1]"


def regex_or_empty(v: str) -> str | None:
    try:
        re.compile(v)
    except re.error as exc:
        return f"a Python regular expression that compiles ({exc}), or empty"
    return None


def edge_keys(v: Mapping[str, Any]) -> str | None:
    allowed = ("a mapping of user names (letters, digits, ., _ or -, at most 64) to keys of 16 to 256 letters, "
               "digits or ._~+/=-, no key shared")
    keys = [str(key) for key in v.values()]
    ok = (all(_EDGE_USER.match(str(name)) for name in v) and all(_EDGE_KEY.match(key) for key in keys)
          and len(set(keys)) == len(keys))
    # The mapping itself never goes into the message: its values are secrets.
    return None if ok else allowed


def layer_spec(v: str) -> str | None:
    return None if _LAYERS.match(v) else "inclusive layer ranges and lists such as 15-45 or 1,3,5-7"


RULES: dict[str, Check] = {
    "glm53_group": nonempty,
    "glm53_head_ip": nonempty,
    "glm53_port": between(1, 65535),
    "glm53_master_port": between(1, 65535),
    "glm53_api_bind": address_or_empty,
    "glm53_tensor_parallel_size": at_least(0),
    "glm53_pipeline_parallel_size": at_least(1),
    "glm53_ib_hca": hca_pins,
    "glm53_ib_gid_index": at_least(0),
    "glm53_fabric_min_busbw_gbps": at_least(0),
    "glm53_model_repo": matches(_HF_REPO, "a Hugging Face repo id, org/name"),
    "glm53_model_fallbacks": repo_list,
    "glm53_model_revision": revision,
    "glm53_draft_repo": matches(_HF_REPO, "a Hugging Face repo id, org/name"),
    "glm53_draft_revision": revision,
    "glm53_hf_endpoint": url_or_empty,
    "glm53_hf_cache_dir": absolute_path_or_empty,
    "glm53_hf_allow_patterns": string_list,
    "glm53_hf_ignore_patterns": string_list,
    "glm53_image": matches(_IMAGE_REF, "an image reference such as registry/name:tag"),
    "glm53_image_base": matches(_IMAGE_REF, "an image reference such as registry/name:tag[@sha256:...]"),
    "glm53_image_build_args": env_mapping,
    "glm53_image_platform": matches(_PLATFORM, "one platform such as linux/arm64", empty_ok=True),
    "glm53_image_ship_compression_level": between(1, 19),
    "glm53_image_ship_stall_timeout": at_least(1),
    "glm53_image_ship_attempts": at_least(1),
    "glm53_image_ship_timeout": at_least(1),
    "glm53_served_model_name": nonempty,
    "glm53_max_model_len": at_least(1),
    "glm53_gpu_memory_utilization": between(0, 1, low_open=True),
    "glm53_kv_cache_memory_bytes": at_least(0),
    "glm53_memory_reserve_gib": at_least(0),
    "glm53_oom_guard_min_available_percent": between(1, 50),
    "glm53_max_num_seqs": at_least(1),
    "glm53_max_num_batched_tokens": at_least(1),
    "glm53_kernel_config": kernel_config,
    "glm53_block_size": at_least(0),
    "glm53_long_prefill_token_threshold": at_least(0),
    "glm53_limit_mm": mm_limits,
    "glm53_dflash_tokens": between(1, 16),
    "glm53_mtp_tokens": between(1, 8),
    "glm53_draft_tensor_parallel_size": at_least(1),
    "glm53_extra_serve_args": string_list,
    "glm53_engine_env": env_mapping,
    "glm53_container_prefix": matches(_DOCKER_NAME, "a docker container name prefix ([a-zA-Z0-9][a-zA-Z0-9_.-]*)"),
    "glm53_shm_size": matches(_DOCKER_SIZE, "a docker size such as 32g or 1024m"),
    "glm53_stop_timeout": at_least(0),
    "glm53_cache_dir": absolute_path_or_empty,
    "glm53_keep_states": between(1, 10),
    "glm53_upgrade_grace": at_least(0),
    "glm53_ready_timeout": at_least(1),
    "glm53_health_poll_interval": at_least(1),
    "glm53_canary_prompt": nonempty,
    "glm53_canary_expect": regex_or_empty,
    # A revision or threshold the gate reads only after the whole launch: refused before anything starts.
    "glm53_quality_repo": matches(_HF_REPO, "a Hugging Face repo id, org/name", empty_ok=True),
    "glm53_quality_revision": revision,
    "glm53_quality_max_kld": at_least(0),
    "glm53_quality_min_top1": between(0, 1),
    "glm53_canary_max_tokens": at_least(1),
    "glm53_log_tail": at_least(0),
    "glm53_lock_timeout": at_least(0),
    "glm53_self_heal_grace": at_least(0),
    "glm53_self_heal_poll_interval": at_least(1),
    "glm53_self_heal_backoff": at_least(0),
    "glm53_self_heal_backoff_max": at_least(0),
    "glm53_self_heal_max_attempts": at_least(1),
    "glm53_self_heal_stable_after": at_least(0),
    "glm53_monitoring_prometheus_image": matches(_IMAGE_REF, "an image reference", empty_ok=True),
    "glm53_monitoring_node_exporter_image": matches(_IMAGE_REF, "an image reference", empty_ok=True),
    "glm53_monitoring_collector_image": matches(_IMAGE_REF, "an image reference", empty_ok=True),
    "glm53_monitoring_prometheus_port": between(1, 65535),
    "glm53_monitoring_node_exporter_port": between(1, 65535),
    "glm53_monitoring_scrape_interval": at_least(1),
    "glm53_monitoring_retention": matches(_PROM_DURATION, "a Prometheus duration such as 15d"),
    "glm53_monitoring_canary_interval": at_least(0),
    "glm53_monitoring_down_for": matches(_PROM_DURATION, "a Prometheus duration such as 1m"),
    "glm53_monitoring_degraded_for": matches(_PROM_DURATION, "a Prometheus duration such as 5m"),
    "glm53_monitoring_kv_cache_max": between(0, 1, low_open=True),
    "glm53_monitoring_preemptions_max": at_least(0),
    "glm53_monitoring_spec_acceptance_min": fraction,
    "glm53_monitoring_memory_headroom_min": fraction,
    "glm53_grafana_url": url_or_empty,
    "glm53_edge_image": matches(_IMAGE_REF, "an image reference such as nginx:1.28.0-bookworm"),
    "glm53_edge_port": between(1, 65535),
    "glm53_edge_keys": edge_keys,
    "glm53_edge_max_requests_per_key": at_least(0),
    "glm53_edge_max_requests": at_least(0),
    "glm53_edge_retry_after": at_least(1),
    "glm53_edge_tls_cert": absolute_path_or_empty,
    "glm53_edge_tls_key": absolute_path_or_empty,
    "glm53_edge_tls_local_ca_dir": absolute_path_or_empty,
    "glm53_router_port": between(1, 65535),
    "glm53_router_bind": address_or_empty,
    "glm53_router_health_interval": between(1, 60),
    "glm53_router_health_failures": between(1, 10),
    "glm53_router_metrics_port": between(1, 65535),
    "glm53_router_drain_timeout": between(0, 3600),
    "glm53_ablation_layers": layer_spec,
    "glm53_ablation_alpha": positive,
    "glm53_ablation_donor_dir": absolute_path_or_empty,
}

_CONVERT: dict[str, Callable[[Any], Any]] = {
    "int": as_int,
    "float": as_float,
    "bool": as_bool,
    "str": as_str,
}


def _typed(value: Any, kind: str) -> Any:
    """The value as Ansible's argument spec would accept it (`-e` hands over strings), or ValueError."""
    if kind in _CONVERT:
        return _CONVERT[kind](value)
    if kind == "list" and not isinstance(value, list):
        raise ValueError(f"{value!r} is not a list")
    if kind == "dict" and not isinstance(value, Mapping):
        raise ValueError(f"{value!r} is not a mapping")
    return value


def _subject(message: str) -> str:
    return message.split()[0].rstrip(":") if message else ""


def settings_errors(settings: Mapping[str, Any], spec: Mapping[str, Mapping[str, Any]],
                    also: Sequence[str] = ()) -> list[str]:
    """Every setting in `settings` that its spec entry or its rule refuses, each message naming it, then the
    messages in `also` (another check's) minus those about a setting already refused here."""
    errors = []
    for name, value in settings.items():
        entry = spec.get(name)
        if entry is None or (value is None and not entry.get("required")):
            continue
        try:
            value = _typed(value, entry.get("type", "raw"))
        except ValueError as exc:
            errors.append(f"{name}: {exc}; expected {entry.get('type')}")
            continue
        if "choices" in entry and value not in entry["choices"]:
            errors.append(f"{name} must be one of {', '.join(map(str, entry['choices']))} (got {value!r})")
            continue
        check = RULES.get(name)
        allowed = check(value) if check else None
        if allowed:
            shown = "not shown, a secret" if entry.get("no_log") else repr(settings[name])
            errors.append(f"{name} must be {allowed} (got {shown})")
    refused = {_subject(message) for message in errors}
    # dict.fromkeys: once each, in order (the serve check in `also` applies some of the same rules between settings).
    return list(dict.fromkeys(errors + [message for message in
                                        [*also, *edge_errors(settings), *router_errors(settings),
                                         *ablation_errors(settings)]
                                        if _subject(message) not in refused]))


def ablation_errors(settings: Mapping[str, Any]) -> list[str]:
    """What each ablation method needs, refused before any rank stops: without it the overlay refuses to load in
    the new ranks, after the old ones were stopped."""
    # Defaults come with the settings (the argument spec's); a missing or mistyped switch is settings_errors' own.
    try:
        enabled = as_bool(settings.get("glm53_ablation_enabled"))
    except ValueError:
        return []
    method = settings.get("glm53_ablation_method")
    needs = {"proj": ("glm53_ablation_direction", "the path on the controller of the direction file"),
             "transplant": ("glm53_ablation_donor_dir", "the path on every node of the donor directory")}
    if not enabled or method not in needs or settings.get(needs[method][0]):
        return []
    name, what = needs[method]
    return [f"{name} must be set when glm53_ablation_enabled is true and glm53_ablation_method is {method} ({what})"]


def router_errors(settings: Mapping[str, Any]) -> list[str]:
    """The router's ports against the other services' (each may share a host with the router)."""
    ports = {}
    for name in ("glm53_port", "glm53_master_port", "glm53_edge_port", "glm53_router_metrics_port"):
        try:
            ports[name] = as_int(settings[name]) if name in settings else None
        except (TypeError, ValueError):
            ports[name] = None
    errors = []
    for name in ("glm53_router_port", "glm53_router_metrics_port"):
        try:
            port = as_int(settings[name]) if name in settings else None
        except (TypeError, ValueError):
            continue
        clash = [other for other, value in ports.items() if other != name and port is not None and value == port]
        if clash:
            errors.append(f"{name} ({port}) must differ from {' and '.join(clash)}")
    return errors


def edge_errors(settings: Mapping[str, Any]) -> list[str]:
    """The rules between the API edge's settings (only where each value is of its type: a mistyped one is
    settings_errors' own)."""
    def value(name: str, convert: Callable[[Any], Any]) -> Any:
        try:
            return convert(settings[name]) if name in settings else None
        except (TypeError, ValueError):
            return None

    errors = []
    keys = settings.get("glm53_edge_keys")
    if value("glm53_edge", as_bool) and isinstance(keys, Mapping) and not keys:
        errors.append("glm53_edge_keys must name at least one user and key when glm53_edge is on")
    port = value("glm53_edge_port", as_int)
    taken = {name: value(name, as_int) for name in ("glm53_port", "glm53_master_port")}
    clash = [name for name, other in taken.items() if port is not None and other == port]
    if clash:
        errors.append(f"glm53_edge_port ({port}) must differ from {' and '.join(clash)}")
    # 0 resolves to glm53_max_num_seqs and twice it (roles/edge), which always agree.
    per_key = value("glm53_edge_max_requests_per_key", as_int)
    overall = value("glm53_edge_max_requests", as_int)
    if per_key and overall and per_key > overall:
        errors.append(f"glm53_edge_max_requests_per_key ({per_key}) must be <= glm53_edge_max_requests ({overall})")
    if bool(settings.get("glm53_edge_tls_cert")) != bool(settings.get("glm53_edge_tls_key")):
        errors.append("glm53_edge_tls_cert and glm53_edge_tls_key must be set together (or both left empty)")
    if value("glm53_edge_tls_local_ca", as_bool) and settings.get("glm53_edge_tls_cert"):
        errors.append("glm53_edge_tls_local_ca and glm53_edge_tls_cert are two ways to the edge's certificate: set one")
    return errors


def serve_settings_errors(settings: Mapping[str, Any], spec: Mapping[str, Mapping[str, Any]], *,
                          num_attention_heads: int = 64) -> list[str]:
    """Every reason the serve settings (keyed without `glm53_`) cannot start vLLM: each setting on its own,
    then the rules between them."""
    return settings_errors({var(key): value for key, value in settings.items()}, spec,
                           also=validate_settings(settings, num_attention_heads=num_attention_heads))
