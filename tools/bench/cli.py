"""Measure decode speed and speculative-decoding acceptance of a running GLM-5.3 Flash API.

    python -m tools.bench --base-url http://10.0.0.1:8888 --model GLM-5.3-Flash-EXL3 \\
        [--runs 5] [--max-tokens 400] [--concurrency 1,2,4] [--phases structured,prose,code] \\
        [--out bench-results] [--warmup-wait 300] [--coherence] [--server-info FILE]

Streams /v1/chat/completions the way the recipe's bench_decode does (greedy, thinking off, usage in
the stream), reads spec-decode and prefix-cache counters from /metrics around every phase x
concurrency cell, and writes one glm53-bench/2 JSON (docs/benchmark-schema.md) and one PNG per run.

Exit status: 0 measured; 1 measured but some request failed or a coherence probe failed; 2 the server
could not be measured (/health failed, never idle, bad arguments).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console

from .phases import MIXED, PHASES
from .prometheus_deltas import has_spec_decode
from .report_schema import SCHEMA_ID, validate_report
from .results_table import mixed_table, results_table
from .server_info import load_server_info, serve_argv, spec_config
from .server_probe import Server, ServerError, wait_until_idle

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_UNUSABLE = 0, 1, 2


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _phase_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in PHASES and n != MIXED]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown phase(s) {unknown or text!r}; "
                                         f"choose from {', '.join([*PHASES, MIXED])}")
    return names


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--base-url", required=True, help="API root, e.g. http://10.0.0.1:8888 (a /v1 suffix is fine)")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--api-key-env", default="GLM53_API_KEY",
                        help="environment variable holding the API key (default %(default)s; unset = no key)")
    parser.add_argument("--runs", type=int, default=5, help="requests per concurrent stream (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=400, help="tokens per request (default %(default)s)")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 2, 4],
                        help="comma-separated stream counts (default 1,2,4)")
    parser.add_argument("--phases", type=_phase_list, default=list(PHASES),
                        help=f"comma-separated phases (default {','.join(PHASES)}); `{MIXED}` adds the long-prompt "
                             "phase (docs/prefill.md)")
    parser.add_argument("--mixed-streams", type=int, default=2,
                        help="mixed phase: decode streams running while the long prompt arrives (default %(default)s)")
    parser.add_argument("--mixed-long-tokens", type=int, default=100_000,
                        help="mixed phase: size of the cold long prompt in tokens (default %(default)s)")
    parser.add_argument("--mixed-decode-tokens", type=int, default=400,
                        help="mixed phase: max_tokens of each decode stream (default %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="results folder (default %(default)s)")
    parser.add_argument("--warmup-wait", type=float, default=300.0,
                        help="seconds to wait for the server to go idle first; 0 skips the wait "
                             "(default %(default)s)")
    parser.add_argument("--coherence", action="store_true",
                        help="also send a few probes whose answers must read as text")
    parser.add_argument("--server-info", type=Path,
                        help="JSON with the server's launch settings (serve_argv, ...) to record with the results")
    parser.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between idle polls (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds allowed per request (default %(default)s)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.max_tokens < 2:
        parser.error("--runs must be >= 1 and --max-tokens >= 2 (decode speed needs two tokens)")
    if args.mixed_streams < 1 or args.mixed_long_tokens < 16 or args.mixed_decode_tokens < 32:
        parser.error("--mixed-streams must be >= 1, --mixed-long-tokens >= 16, --mixed-decode-tokens >= 32")
    return args


def _title_mixed(report: dict[str, Any]) -> str:
    argv = report["server"]["serve_argv"] or []
    knobs = [f"{a}={b}" for a, b in zip(argv, argv[1:])
             if a in ("--max-num-batched-tokens", "--long-prefill-token-threshold")]
    knobs += [a for a in argv if a == "--long-prefill-token-threshold-adaptive"]
    return f"{report['target']['model']} mixed phase, {report['created_utc']}  " + " ".join(knobs)


def _api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    err = Console(stderr=True)
    root = _api_root(args.base_url)
    server = Server(root, os.environ.get(args.api_key_env) or None)
    try:
        server.check_health()
        info = load_server_info(args.server_info) if args.server_info else None
        idle_wait_s = (wait_until_idle(server.metrics, args.warmup_wait, poll_s=args.poll_interval)
                       if args.warmup_wait > 0 else None)
    except (ServerError, OSError, ValueError) as exc:
        err.print(f"[bold red]bench_decode: cannot measure:[/] {exc}", highlight=False)
        return EXIT_UNUSABLE

    # Imported after the checks: the OpenAI client takes seconds to import, a dead server should fail fast.
    import openai

    from .runner import TEMPERATURE, TOP_P, Benchmark

    snapshot = server.metrics()
    client = openai.OpenAI(base_url=root + "/v1", api_key=server.api_key or "EMPTY",
                           # A retried request would be timed as one slow request.
                           max_retries=0, timeout=args.timeout)
    bench = Benchmark(client, server, args.model, args.runs, args.max_tokens, args.concurrency)
    report: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tool": {"name": "bench_decode", "argv": list(sys.argv if argv is None else ["bench_decode", *argv])},
        "target": {"base_url": root, "model": args.model},
        "settings": {
            "runs": args.runs, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
            "phases": args.phases, "temperature": TEMPERATURE, "top_p": TOP_P, "enable_thinking": False,
            "warmup_wait_s": args.warmup_wait,
            "mixed": {"streams": args.mixed_streams, "long_prompt_tokens": args.mixed_long_tokens,
                      "decode_tokens": args.mixed_decode_tokens} if MIXED in args.phases else None,
        },
        "server": {
            "models": server.models(),
            "metrics_available": snapshot is not None,
            "spec_decode_metrics": snapshot is not None and has_spec_decode(snapshot),
            "spec_config": spec_config(info),
            "serve_argv": serve_argv(info),
            "info": info,
            "idle_wait_s": idle_wait_s,
        },
        "coherence": None,
        "phases": [],
        "mixed": None,
        "warnings": bench.warnings,
        "artifacts": {"plot": None, "mixed_plot": None},
    }
    if args.coherence:
        err.print("coherence probes ...")
        report["coherence"] = bench.coherence()
    for name in (n for n in args.phases if n != MIXED):
        err.print(f"phase {name}: concurrency {','.join(map(str, args.concurrency))} x {args.runs} runs ...")
        report["phases"].append(bench.measure_phase(PHASES[name]))
    if MIXED in args.phases:
        from .mixed import MixedSettings, run_mixed

        err.print(f"phase {MIXED}: {args.mixed_streams} stream(s) decoding while a cold "
                  f"~{args.mixed_long_tokens}-token prompt arrives ...")
        try:
            wait_until_idle(server.metrics, args.warmup_wait or 60.0, poll_s=args.poll_interval)
            report["mixed"] = run_mixed(client, args.model, lambda text: server.count_tokens(args.model, text),
                                        MixedSettings(args.mixed_streams, args.mixed_long_tokens,
                                                      args.mixed_decode_tokens), timeout_s=args.timeout)
        except ServerError as exc:
            bench.warnings.append(f"{MIXED} phase not measured: {exc}")

    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench-" + report["created_utc"].replace(":", "").replace("+0000", "Z")
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    try:
        if report["phases"]:
            from .decode_plot import write_decode_plot

            write_decode_plot(report, png_path)
            report["artifacts"]["plot"] = png_path.name
    except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
        bench.warnings.append(f"plot not written: {type(exc).__name__}: {exc}")
    if report["mixed"] is not None:
        mixed_png = args.out / f"{stem}-mixed.png"
        try:
            from .mixed_plot import write_mixed_plot

            write_mixed_plot(report["mixed"], _title_mixed(report), mixed_png)
            report["artifacts"]["mixed_plot"] = mixed_png.name
        except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
            bench.warnings.append(f"mixed plot not written: {type(exc).__name__}: {exc}")
    problems = validate_report(report)
    json_path.write_text(json.dumps(report, indent=2) + "\n")

    if report["phases"]:
        Console().print(results_table(report))
    if report["mixed"] is not None:
        Console().print(mixed_table(report["mixed"]))
    for warning in bench.warnings:
        err.print(f"[yellow]warning:[/] {warning}", highlight=False)
    print(f"results: {json_path}")
    if report["artifacts"]["plot"]:
        print(f"plot: {png_path}")
    if report["artifacts"]["mixed_plot"]:
        print(f"mixed plot: {args.out / report['artifacts']['mixed_plot']}")
    if problems:
        # A bug in this tool, not in the server: say so loudly, the file is still written for inspection.
        err.print("[bold red]the result does not match " + SCHEMA_ID + ":[/]\n  " + "\n  ".join(problems))
        return EXIT_FAILED_REQUESTS
    failed = sum(level["errors"] for phase in report["phases"] for level in phase["levels"])
    failed += len(report["mixed"]["errors"]) if report["mixed"] else 0
    coherent = report["coherence"] is None or report["coherence"]["passed"]
    if failed or not coherent:
        err.print(f"[bold red]{failed} request(s) failed[/]" if failed else "[bold red]coherence probes failed[/]")
        return EXIT_FAILED_REQUESTS
    return EXIT_OK
