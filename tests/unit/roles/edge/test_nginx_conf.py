"""The edge's nginx config (roles/edge/templates/nginx.conf.j2) as the role renders it: every key and only those
keys admit a request, the limits the settings resolve to, TLS only when asked, vLLM's key on the way in.
molecule default's verify_edge.yml serves the TLS rendering through nginx; `nginx -t` here checks both."""
from __future__ import annotations

import datetime
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

REPO = Path(__file__).resolve().parents[4]
ROLE_VARS = yaml.safe_load((REPO / "roles/edge/vars/main.yml").read_text())
ENV = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
ENV.filters["bool"] = lambda value: str(value).lower() in ("true", "1", "yes")  # Ansible's, for these values
KEYS = {"bob": "key-of-bob-000000002", "alice": "key-of-alice-0000001"}
IMAGE = "glm53-sim/edge:latest"  # make images


def resolved(name: str, settings: dict[str, Any]) -> Any:
    """A role var rendered the way Ansible would, for the plain-Jinja expressions these are."""
    return ENV.from_string(ROLE_VARS[name]).render(**settings).strip()


def render(tls: bool, **changes: Any) -> str:
    settings: dict[str, Any] = {
        "glm53_max_num_seqs": 4, "glm53_edge_max_requests_per_key": 0, "glm53_edge_max_requests": 0,
        "glm53_edge_keys": KEYS, "glm53_edge_port": 8443, "glm53_edge_retry_after": 5, "glm53_api_key": "engine-key",
        "glm53_port": 8888, "glm53_head_ip": "10.0.0.1", "glm53_api_bind": "",
        # Without replica groups the router is off; with it, as roles/glm53/vars/main.yml resolves its address.
        "_glm53_router_on": False, "_edge_host": "spark1", "_glm53_router_host": "spark1", "glm53_router_port": 8100,
        "_glm53_router_local_ip": "127.0.0.1", "_glm53_router_ip": "10.0.0.1", **changes}
    settings["_edge_api_ip"] = resolved("_edge_api_ip", settings)
    for name in ("_edge_upstream", "_edge_max_per_key", "_edge_max_all"):
        settings[name] = resolved(name, settings)
    template = ENV.from_string((REPO / "roles/edge/templates/nginx.conf.j2").read_text())
    return template.render(ansible_managed="test", _edge_tls=tls, _edge_mount=ROLE_VARS["_edge_mount"], **settings)


def test_each_key_maps_to_its_user_and_nothing_else_does() -> None:
    conf = render(tls=False)
    assert re.findall(r'^\s*"Bearer (\S+)" "(\S+)";$', conf, re.MULTILINE) == [
        ("key-of-alice-0000001", "alice"), ("key-of-bob-000000002", "bob")]
    assert re.search(r'map \$http_authorization \$glm53_user \{\s*default "";', conf)
    assert re.search(r'if \(\$glm53_user = ""\) \{[^}]*return 401', conf)


def limits(conf: str) -> tuple[str, str]:
    return (re.findall(r"limit_conn glm53_per_key (\d+);", conf)[0],
            re.findall(r"limit_conn glm53_all (\d+);", conf)[0])


@pytest.mark.parametrize(("per_key", "overall", "expected"), [(0, 0, ("4", "8")), (2, 6, ("2", "6"))])
def test_limits_resolve_from_the_engines_batch_when_zero(per_key: int, overall: int, expected: tuple[str, str]) -> None:
    conf = render(tls=False, glm53_edge_max_requests_per_key=per_key, glm53_edge_max_requests=overall)
    assert limits(conf) == expected
    assert "limit_conn_status 429;" in conf and "add_header Retry-After 5 always;" in conf


def test_tls_only_when_asked() -> None:
    plain, tls = render(tls=False), render(tls=True)
    assert "ssl" not in plain and re.search(r"^\s*listen 8443;$", plain, re.MULTILINE)
    assert re.search(r"^\s*listen 8443 ssl;$", tls, re.MULTILINE)
    assert "ssl_certificate_key /etc/glm53-edge/tls/key.pem;" in tls


@pytest.mark.parametrize(("api_key", "header"), [("engine-key", '"Bearer engine-key"'), ("", '""')])
def test_vllms_own_key_replaces_the_clients(api_key: str, header: str) -> None:
    assert f"proxy_set_header Authorization {header};" in render(tls=False, glm53_api_key=api_key)


@pytest.mark.parametrize(("bind", "upstream"), [("", "10.0.0.1:8888"), ("0.0.0.0", "10.0.0.1:8888"),
                                                ("127.0.0.1", "127.0.0.1:8888"), ("fd00::1", "[fd00::1]:8888")])
def test_the_upstream_is_where_vllm_listens(bind: str, upstream: str) -> None:
    assert f"proxy_pass http://{upstream};" in render(tls=False, glm53_api_bind=bind)


def write_self_signed(folder: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edge")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))


def _image_present() -> bool:
    docker = shutil.which("docker")
    return bool(docker) and subprocess.run([docker or "docker", "image", "inspect", IMAGE], capture_output=True,
                                           check=False).returncode == 0


@pytest.mark.integration
@pytest.mark.skipif(not _image_present(), reason=f"needs docker and {IMAGE} (make images)")
@pytest.mark.parametrize("tls", [False, True])
def test_nginx_accepts_both_renderings(tls: bool, tmp_path: Path) -> None:
    (tmp_path / "nginx.conf").write_text(render(tls=tls))
    (tmp_path / "tls").mkdir()
    if tls:
        write_self_signed(tmp_path / "tls")
    mount = ROLE_VARS["_edge_mount"]
    result = subprocess.run(["docker", "run", "--rm", "-v", f"{tmp_path}:{mount}:ro", IMAGE,
                             "nginx", "-t", "-c", f"{mount}/nginx.conf"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("edge_host", "upstream"), [("spark1", "127.0.0.1:8100"), ("spark3", "10.0.0.1:8100")])
def test_in_front_of_replica_groups_the_upstream_is_the_router(edge_host: str, upstream: str) -> None:
    conf = render(tls=False, _glm53_router_on=True, _edge_host=edge_host)
    assert f"proxy_pass http://{upstream};" in conf and ":8888" not in conf
    # The edge's /health answers while any group serves: the router's /readiness, not its all-groups /health.
    assert re.search(r"location = /health \{\s*(#[^\n]*\s*)?proxy_pass http://%s/readiness;" % re.escape(upstream), conf)
