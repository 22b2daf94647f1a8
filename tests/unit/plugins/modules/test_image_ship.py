# SPDX-License-Identifier: MIT
"""The image_ship module as Ansible runs it, with stand-in `docker` and `ssh` first on PATH and the real zstd:
a ship that arrives byte for byte, one whose destination stalls every time (killed, retried, failed with a
message naming the cause), check mode shipping nothing, and bad arguments named."""
from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Dict

import pytest

ModuleRunner = Callable[..., Dict[str, Any]]
N = 2 * 1024 * 1024 + 5
ARGS = {"image": "sparkops/glm53-engine:local", "destinations": [{"destination": "spark@10.0.0.2", "name": "spark2"}],
        "compression_level": 3, "stall_timeout": 0.5, "attempts": 2, "timeout": 30}

needs_zstd = pytest.mark.skipif(not shutil.which("zstd"), reason="needs the zstd binary (Debian package zstd)")


def stand_ins(tmp_path: Path, load: str, data: str = "b'l' * %d" % N) -> Dict[str, str]:
    """`docker image save` writes `data`, `docker image load` runs `load`; `ssh` runs its last argument."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "docker": "#!/bin/sh\ncase \"$1 $2\" in\n"
                  "  'image save') exec %s -c \"import os, sys; sys.stdout.buffer.write(%s)\" ;;\n"
                  "  'image load') %s ;;\n"
                  "  *) echo \"unexpected docker $*\" >&2; exit 99 ;;\nesac\n" % (sys.executable, data, load),
        "ssh": "#!/bin/sh\nfor last; do :; done\nexec sh -c \"$last\"\n",
    }
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return {"PATH": "%s%s%s" % (bin_dir, os.pathsep, os.environ.get("PATH", ""))}


@needs_zstd
def test_a_ship_arrives_whole_and_reports_time_bytes_and_attempts(tmp_path: Path, run_module: ModuleRunner) -> None:
    loaded = tmp_path / "loaded"
    env = stand_ins(tmp_path, "cat > %s; echo 'Loaded image: sparkops/glm53-engine:local'" % loaded)
    result = run_module("image_ship", ARGS, env=env)
    assert not result.get("failed"), result
    assert result["changed"] is True
    shipped, = result["results"]
    assert shipped["ok"] and shipped["attempts"] == 1 and shipped["name"] == "spark2"
    assert loaded.read_bytes() == b"l" * N
    assert result["raw_bytes"] == N and 0 < shipped["wire_bytes"] < N // 100
    assert shipped["attempt_log"][0]["detail"] == "Loaded image: sparkops/glm53-engine:local"
    report, = result["reports"]
    assert report.startswith("image ship to spark2: ok in ")
    assert ", 2.0 MiB raw, " in report and report.endswith(", 1 attempt")


@needs_zstd
def test_two_destinations_each_get_the_image_and_a_report_line(tmp_path: Path, run_module: ModuleRunner) -> None:
    # The stand-in ssh runs its last argument; each destination's load writes where its user name says.
    env = stand_ins(tmp_path, 'cat > %s/loaded-"$GLM53_TEST_DEST"' % tmp_path)
    (tmp_path / "bin" / "ssh").write_text('#!/bin/sh\nfor last; do :; done\n'
                                          'for a; do case "$a" in *@*) dest=${a%%@*};; esac; done\n'
                                          'GLM53_TEST_DEST=$dest exec sh -c "$last"\n')
    args = dict(ARGS, destinations=[{"destination": "a@10.0.0.2", "name": "spark2"},
                                    {"destination": "b@10.0.0.3"}])
    result = run_module("image_ship", args, env=env)
    assert not result.get("failed"), result
    assert (tmp_path / "loaded-a").read_bytes() == (tmp_path / "loaded-b").read_bytes() == b"l" * N
    assert [r["name"] for r in result["results"]] == ["spark2", "b@10.0.0.3"]
    assert [line.split(":")[0] for line in result["reports"]] == ["image ship to spark2", "image ship to b@10.0.0.3"]
    assert " | tee >(ssh " in result["command"]


@needs_zstd
def test_a_destination_that_stalls_every_time_fails_naming_the_stall(
        tmp_path: Path, run_module: ModuleRunner) -> None:
    # Incompressible, so the compressed stream is larger than the pipes between here and the stalled load.
    env = stand_ins(tmp_path, "sleep 60", data="os.urandom(%d)" % N)
    result = run_module("image_ship", dict(ARGS, hint="Raise glm53_image_ship_stall_timeout."), env=env)
    assert result["failed"] and result["results"][0]["attempts"] == 2
    assert [a["outcome"] for a in result["results"][0]["attempt_log"]] == ["stalled", "stalled"]
    assert result["msg"].startswith("Could not ship the engine image to spark2: attempt 1 stalled after ")
    assert "no byte moved for 0." in result["msg"]
    assert "the worker's old image is untouched" in result["msg"]
    assert result["msg"].endswith("Raise glm53_image_ship_stall_timeout.")
    assert "FAILED" in result["reports"][0]


def test_check_mode_ships_nothing_and_says_what_it_would_run(tmp_path: Path, run_module: ModuleRunner) -> None:
    env = stand_ins(tmp_path, "touch %s" % (tmp_path / "ran"))
    result = run_module("image_ship", ARGS, check=True, env=env)
    assert result["changed"] is True and result["results"] == []
    assert not (tmp_path / "ran").exists()
    assert result["command"] == (
        "docker image save sparkops/glm53-engine:local | zstd -3 -T0 -q -c | ssh -o BatchMode=yes "
        "-o StrictHostKeyChecking=accept-new -o ConnectTimeout=10 -o ServerAliveInterval=1 -o ServerAliveCountMax=3 "
        "spark@10.0.0.2 'zstd -dc | docker image load'")
    assert result["reports"][0].startswith("image ship to spark2: would ship sparkops/glm53-engine:local")


def test_bad_arguments_are_all_named(run_module: ModuleRunner) -> None:
    result = run_module("image_ship", dict(ARGS, compression_level=0, attempts=0, stall_timeout=0, destinations=[]),
                        check=True)
    assert result["failed"]
    assert result["msg"] == ("stall_timeout must be > 0 (got 0.0); attempts must be >= 1 (got 0); "
                             "compression_level must be in [1, 19] (got 0); destinations must name at least one "
                             "destination")
