"""Check the API edge (roles/edge) the way its users meet it, with the openai client.

    GLM53_EDGE_KEYS='{"alice": "...", "bob": "...", "carol": "..."}' \
    python tools/edge_check.py --url https://HOST:PORT/v1 --model NAME --cert cert.pem [--ca ca.pem] --retry-after 7

Needs three keys and an edge allowing one request in flight per key and two overall (inventory/sim). Checks, each
printed with its evidence: the certificate served is --cert's (the client verifies it against --ca); a known key gets
an answer; no key and a wrong key get 401; a second request of a key with a stream open gets 429 with Retry-After
at once while another key is answered; with two streams open a third key gets 429; once the streams end the first
key is answered again.
With --redeploy, instead: a stream open across a redeployment that adds a key ends whole, and the new key is
answered. Exits 1 when any check fails.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import openai
from openai import OpenAI

THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


class Edge:
    def __init__(self, url: str, model: str, ca: str | None) -> None:
        self.url, self.model, self.ca = url, model, ca
        self.failures: list[str] = []

    def http(self) -> httpx.Client:
        return httpx.Client(verify=ssl.create_default_context(cafile=self.ca) if self.ca else True, timeout=120)

    def client(self, key: str) -> OpenAI:
        # No retries: the SDK would otherwise wait out the Retry-After of a 429 and try again.
        return OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120, http_client=self.http())

    def without_key(self) -> int:
        """The status of a chat request with no Authorization header (the SDK always sends one)."""
        body = {"model": self.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        return self.http().post(f"{self.url}/chat/completions", json=body).status_code

    def ask(self, key: str) -> str:
        reply = self.client(key).chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "What do the two machines do?"}],
            max_tokens=8, temperature=0, extra_body=THINKING_OFF)
        return reply.choices[0].message.content or ""

    @contextmanager
    def stream(self, key: str) -> Iterator[Iterator[object]]:
        """A generation in flight at the edge until the block ends (its first chunk has arrived); the block may
        read the rest."""
        chunks = self.client(key).chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Tell a long story about the cluster."}],
            max_tokens=900, temperature=0, stream=True, extra_body={**THINKING_OFF, "ignore_eos": True})
        rest = iter(chunks)
        try:
            next(rest, None)
            yield rest
        finally:
            chunks.close()

    def check(self, name: str, ok: bool, evidence: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {evidence}")
        if not ok:
            self.failures.append(name)

    def status_of(self, call: Callable[[], object]) -> tuple[int, dict[str, str], float]:
        start = time.monotonic()
        try:
            call()
            return 200, {}, time.monotonic() - start
        except openai.APIStatusError as exc:
            return exc.status_code, dict(exc.response.headers), time.monotonic() - start


def reload_while_streaming(edge: Edge, key: str, argv: list[str], new_key: str) -> None:
    """Run a redeployment with a stream open: the stream must still end whole (a restart past nginx's graceful
    window would cut it; whether the edge restarted at all is the caller's to read from docker), and the key the
    redeployment adds must be answered."""
    with edge.stream(key) as rest:
        run = subprocess.run(argv, capture_output=True, text=True, check=False)
        chunks, ending = 0, "no end"
        try:
            for chunk in rest:
                chunks += 1
                reason = chunk.choices[0].finish_reason if chunk.choices else None  # type: ignore[attr-defined]
                ending = f"finish_reason {reason}" if reason else ending
        except (openai.APIError, httpx.HTTPError) as exc:
            ending = f"error {exc!r}"
    edge.check("the redeployment ran", run.returncode == 0, " | ".join(run.stdout.splitlines()[-4:]))
    edge.check("a stream open across the redeployment ends whole", ending == "finish_reason length",
               f"{chunks} chunks after it, {ending}")
    answer = edge.ask(new_key)
    edge.check("the key the redeployment added is answered", bool(answer.strip()), repr(answer))


def served_certificate(url: str) -> bytes:
    parts = urlsplit(url)
    pem = ssl.get_server_certificate((parts.hostname or "", parts.port or 443))
    return ssl.PEM_cert_to_DER_cert(pem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the edge's /v1 URL")
    parser.add_argument("--model", required=True)
    parser.add_argument("--cert", help="the certificate the edge was given (PEM)")
    parser.add_argument("--ca", help="the CA the client trusts (PEM); by default --cert itself")
    parser.add_argument("--retry-after", required=True, help="the Retry-After the edge was configured with")
    parser.add_argument("--redeploy", help="instead of the checks: a command (JSON list) that redeploys the edge with "
                        "one more key, run while a stream is open")
    parser.add_argument("--new-key", help="with --redeploy: the user whose key it adds (in GLM53_EDGE_KEYS)")
    args = parser.parse_args(argv)
    keys = json.loads(os.environ["GLM53_EDGE_KEYS"])
    alice, bob, carol = list(keys.values())[:3]
    edge = Edge(args.url, args.model, args.ca or args.cert)
    if args.redeploy:
        reload_while_streaming(edge, alice, json.loads(args.redeploy), keys[args.new_key])
        return report(edge)

    if args.cert:
        with open(args.cert, encoding="ascii") as pem:
            configured = ssl.PEM_cert_to_DER_cert(pem.read())
        served = served_certificate(args.url)
        edge.check("TLS serves the configured certificate", served == configured,
                   f"served sha256 {hashlib.sha256(served).hexdigest()[:16]}, configured "
                   f"{hashlib.sha256(configured).hexdigest()[:16]}")

    answer = edge.ask(alice)
    edge.check("a known key is answered", bool(answer.strip()), repr(answer))
    code = edge.without_key()
    edge.check("no key gets 401", code == 401, f"HTTP {code}")
    code = edge.status_of(lambda: edge.ask("sk-not-a-key-of-this-edge"))[0]
    edge.check("a wrong key gets 401", code == 401, f"HTTP {code}")

    with edge.stream(alice):
        code, headers, took = edge.status_of(lambda: edge.ask(alice))
        edge.check("a second request of a key with a stream open gets 429 with Retry-After",
                   code == 429 and headers.get("retry-after") == args.retry_after,
                   f"HTTP {code}, Retry-After {headers.get('retry-after')!r} (configured {args.retry_after}), "
                   f"answered in {took:.2f} s")
        answer = edge.ask(bob)
        edge.check("meanwhile another key is answered", bool(answer.strip()), repr(answer))
        with edge.stream(bob):
            code, headers, took = edge.status_of(lambda: edge.ask(carol))
            edge.check("with the endpoint's two requests in flight a third key gets 429 with Retry-After",
                       code == 429 and headers.get("retry-after") == args.retry_after,
                       f"HTTP {code}, Retry-After {headers.get('retry-after')!r}, answered in {took:.2f} s")
    # nginx frees a stream's slot once it notices the client went away (its next write of a token fails).
    start, code = time.monotonic(), 429
    while code == 429 and time.monotonic() - start < 10:
        code = edge.status_of(lambda: edge.ask(alice))[0]
        if code == 429:
            time.sleep(0.2)
    edge.check("after the streams end the key is answered again", code == 200,
               f"HTTP {code} {time.monotonic() - start:.1f} s after the streams were closed")
    return report(edge)


def report(edge: Edge) -> int:
    print(f"{len(edge.failures)} of the edge checks failed" if edge.failures else "every edge check passed")
    return 1 if edge.failures else 0


if __name__ == "__main__":
    sys.exit(main())
