"""Keep chat completions going against an OpenAI-compatible endpoint and record every one, until a stop file appears
or --seconds pass: the client that a rolling restart or a killed replica group must not fail
(molecule/four_nodes/verify_replicas.yml), or that measures an endpoint's throughput.

    python tools/client_loop.py --url http://172.31.253.10:8100/v1 --model GLM-5.3-Flash-EXL3 \\
        --stop-file /tmp/stop --out /tmp/loop.json [--concurrency 2] [--pause 0.5] [--seconds 600]

Each request's prompt starts with its own number, so no two share a prefix and a prefix-cache-aware router spreads
them by load. The openai client does not retry: a failed request is recorded, with its error. --out gets one JSON
object: {"requests": [{"start", "end", "ok", "tokens", "error"}...], "total", "failed", "completion_tokens",
"seconds"}; the same summary without the request list goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from openai import OpenAI


@dataclass
class Record:
    start: float
    end: float
    ok: bool
    tokens: int
    error: str


def run(client: OpenAI, model: str, max_tokens: int, pause: float, stop: threading.Event, records: list[Record],
        counter: Iterator[int], lock: threading.Lock) -> None:
    while not stop.wait(pause):
        with lock:
            number = next(counter)
        start = time.time()
        try:
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Request {number}: how many machines does the cluster have?"}],
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            ok = bool(reply.choices and reply.choices[0].message.content)
            record = Record(start, time.time(), ok, reply.usage.completion_tokens if reply.usage else 0,
                            "" if ok else "empty answer")
        except Exception as exc:  # every failure is what this tool records
            record = Record(start, time.time(), False, 0, f"{type(exc).__name__}: {exc}"[:300])
        with lock:
            records.append(record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the API's base URL, ending in /v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, help="stop once this file exists")
    parser.add_argument("--seconds", type=float, default=600.0, help="stop after this long at the latest")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--pause", type=float, default=0.0,
                        help="seconds each client waits before each request (leaves CPU to what is being tested)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    args = parser.parse_args(argv)

    client = OpenAI(base_url=args.url, api_key=os.environ.get("GLM53_API_KEY", "none"), timeout=args.timeout,
                    max_retries=0)
    stop, lock = threading.Event(), threading.Lock()
    records: list[Record] = []
    counter = iter(range(sys.maxsize))
    work = (client, args.model, args.max_tokens, args.pause, stop, records, counter, lock)
    threads = [threading.Thread(target=run, args=work) for _client in range(args.concurrency)]
    began = time.time()
    for thread in threads:
        thread.start()
    while time.time() - began < args.seconds and not (args.stop_file and args.stop_file.exists()):
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join()
    summary = {"total": len(records), "failed": sum(not r.ok for r in records),
               "completion_tokens": sum(r.tokens for r in records), "seconds": round(time.time() - began, 2)}
    ordered = sorted(records, key=lambda r: r.start)
    args.out.write_text(json.dumps({**summary, "requests": [asdict(r) for r in ordered]}))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
