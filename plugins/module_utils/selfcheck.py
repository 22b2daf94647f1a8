# SPDX-License-Identifier: MIT
# Copyright: (c) 2026, sparkops
"""Run and judge ``glm53-overlay selfcheck`` inside an engine image (``overlay_selfcheck`` module).

The CLI prints one JSON document ``{"ok": bool, "checks": [{"name", "ok", "detail", "skipped"}], "versions": {}}``;
a check that does not apply on the machine (GPU checks without a GPU) reports ``skipped: true``.
vLLM and its plugins may log to stdout before it, so the parser takes the last JSON object in the output.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

DEFAULT_COMMAND = ("glm53-overlay", "selfcheck")
DEFAULT_RUN_ARGS = ("--rm", "--network", "none")
OUTPUT_LIMIT = 4000


class SelfcheckError(ValueError):
    """The output is not a selfcheck report."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "skipped": self.skipped}


@dataclass(frozen=True)
class Report:
    ok: bool
    checks: List[Check] = field(default_factory=list)
    versions: Dict[str, Any] = field(default_factory=dict)

    def first_failure(self) -> Optional[Check]:
        return next((check for check in self.checks if not check.ok), None)


def container_name_of(run_args: Sequence[str]) -> Optional[str]:
    args = list(run_args)
    for i, arg in enumerate(args):
        if arg == "--name" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--name="):
            return arg.split("=", 1)[1]
    return None


def docker_run_argv(
    image: str,
    command: Sequence[str] = DEFAULT_COMMAND,
    run_args: Sequence[str] = DEFAULT_RUN_ARGS,
    env: Optional[Mapping[str, Any]] = None,
    name: Optional[str] = None,
) -> List[str]:
    """``docker run`` for the selfcheck. A container name is added when the caller gave none, so a
    selfcheck that overruns its timeout can be removed (killing the docker client leaves it running).
    The command replaces the image's entrypoint: engine images start `vllm` (or `vllm serve`) by default."""
    argv = ["docker", "run", *run_args, "--entrypoint", command[0]]
    if container_name_of(run_args) is None:
        argv += ["--name", name or "glm53-selfcheck-" + uuid.uuid4().hex[:12]]
    for key in sorted(env or {}):
        argv += ["-e", "%s=%s" % (key, (env or {})[key])]
    argv.append(image)
    argv += list(command[1:])
    return argv


def masked_argv(argv: Sequence[str]) -> List[str]:
    """The argv with environment values hidden (they may hold tokens)."""
    shown: List[str] = []
    mask_next = False
    for arg in argv:
        if mask_next and "=" in arg:
            arg = arg.split("=", 1)[0] + "=********"
        mask_next = arg == "-e"
        shown.append(arg)
    return shown


def _last_json_object(text: str) -> Any:
    stripped = text.strip()
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    found: Any = None
    index = stripped.find("{")
    while index != -1:
        try:
            obj, end = decoder.raw_decode(stripped, index)
        except ValueError:
            index = stripped.find("{", index + 1)
            continue
        if isinstance(obj, dict):
            found = obj
        index = stripped.find("{", end)
    if found is None:
        raise SelfcheckError("selfcheck printed no JSON object")
    return found


def _as_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise SelfcheckError("%s must be a boolean, got %r" % (what, value))
    return value


def parse_report(text: str) -> Report:
    data = _last_json_object(text)
    if not isinstance(data, dict) or "ok" not in data:
        raise SelfcheckError("selfcheck JSON has no 'ok' field")
    raw_checks = data.get("checks", [])
    if not isinstance(raw_checks, list):
        raise SelfcheckError("selfcheck 'checks' must be a list")
    checks: List[Check] = []
    for i, raw in enumerate(raw_checks):
        if not isinstance(raw, dict) or "name" not in raw or "ok" not in raw:
            raise SelfcheckError("selfcheck check #%d lacks 'name' or 'ok'" % i)
        detail = raw.get("detail", "")
        checks.append(Check(str(raw["name"]), _as_bool(raw["ok"], "check %r ok" % raw["name"]),
                            detail if isinstance(detail, str) else json.dumps(detail),
                            _as_bool(raw.get("skipped", False), "check %r skipped" % raw["name"])))
    versions = data.get("versions", {})
    if not isinstance(versions, dict):
        raise SelfcheckError("selfcheck 'versions' must be an object")
    return Report(_as_bool(data["ok"], "'ok'"), checks, versions)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    msg: str
    report: Optional[Report] = None


def evaluate(rc: int, stdout: str, stderr: str, must_run: Sequence[str] = ()) -> Verdict:
    """Judge a finished ``docker run``: the report decides; without a report, the exit status and
    stderr are the evidence. A report claiming ok while a check failed, or ok with a non-zero exit,
    is not trusted. Checks named in ``must_run`` (the GPU checks of a GPU image) may not be skipped
    or missing."""
    try:
        report = parse_report(stdout)
    except SelfcheckError as exc:
        evidence = (stderr.strip() or stdout.strip())[-OUTPUT_LIMIT:]
        return Verdict(False, "overlay selfcheck output unusable (exit %d): %s; output: %s" % (rc, exc, evidence))
    failure = report.first_failure()
    if failure is not None:
        return Verdict(False, "overlay selfcheck failed: %s: %s" % (failure.name, failure.detail), report)
    if not report.ok:
        return Verdict(False, "overlay selfcheck reported ok=false without a failing check (exit %d)" % rc, report)
    if rc != 0:
        return Verdict(False, "overlay selfcheck reported ok but exited %d: %s" % (rc, stderr.strip()[-OUTPUT_LIMIT:]),
                       report)
    ran = {check.name: check for check in report.checks}
    for name in must_run:
        if name not in ran:
            return Verdict(False, "overlay selfcheck has no check %r (overlay too old for this collection?)" % name,
                           report)
        if ran[name].skipped:
            return Verdict(False, "overlay selfcheck skipped %s, which must run here: %s" % (name, ran[name].detail),
                           report)
    return Verdict(True, "overlay selfcheck passed (%d checks)" % len(report.checks), report)


def record_name(image_id: str, command: Sequence[str], run_args: Sequence[str], env: Mapping[str, Any],
                must_run: Sequence[str]) -> str:
    """File name of the record of a passed self-check: one per image ID and way of running it.

    An image's content cannot change under its ID, so a pass recorded for this ID, command, arguments,
    environment and required checks holds until any of them changes (a rebuild is a new ID). Environment
    values only enter through the hash, so no secret is written in the name."""
    what = {"image": image_id, "command": list(command), "run_args": list(run_args),
            "env": {str(k): str(v) for k, v in sorted(env.items())}, "must_run": sorted(must_run)}
    return "selfcheck-%s.json" % hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
