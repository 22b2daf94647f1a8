"""Send one chat completion to the deployment described by an inventory and print the answer.

    python tools/sim_chat.py --inventory inventory/sim [--head HOST] [--check]

Reads the head's (the first host's, or --head's: a replica group's head) fabric address, API port, served model name and (optional) API key from the
inventory the same way the playbooks do, then uses the openai client like any user would. With
--check it exits non-zero unless /v1/models lists the served name and the answer has text.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from openai import OpenAI


def _settings(inventory: Path, head_name: str | None = None) -> dict[str, Any]:
    hosts = yaml.safe_load((inventory / "hosts.yml").read_text())
    sparks = hosts["all"]["children"]["sparks"]["hosts"]
    head = sparks[head_name] if head_name else next(iter(sparks.values()))
    group_vars = inventory / "group_vars" / "sparks.yml"
    settings = yaml.safe_load(group_vars.read_text()) if group_vars.exists() else {}
    return {
        "url": f"http://{head['glm53_fabric_ip']}:{settings.get('glm53_port', 8888)}/v1",
        "model": settings.get("glm53_served_model_name", "GLM-5.3-Flash-EXL3"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inventory", type=Path, default=Path("inventory/sim"))
    parser.add_argument("--head", help="the inventory host whose API to ask (default: the first host)")
    parser.add_argument("--prompt", default="Say hello to the two Sparks in one sentence.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)

    s = _settings(args.inventory, args.head)
    client = OpenAI(base_url=s["url"], api_key=os.environ.get("GLM53_API_KEY", "none"), timeout=300)
    models = [m.id for m in client.models.list()]
    reply = client.chat.completions.create(
        model=s["model"],
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=args.max_tokens,
        temperature=0,
        # Thinking off: the SDK merges extra_body into the top level of the request, as GLM expects.
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    text = reply.choices[0].message.content or ""
    print(f"API: {s['url']}  models: {', '.join(models)}")
    print(f"Q: {args.prompt}")
    print(f"A: {text.strip()}")
    if args.check and (s["model"] not in models or not text.strip()):
        print(f"check failed: served name {s['model']!r} listed={s['model'] in models}, text={text!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
