"""Command line: `glm53-overlay selfcheck` (JSON on stdout, exit 0 only when every check passed)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="glm53-overlay", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("selfcheck", help="check the plugin inside this environment; prints JSON")
    parser.parse_args(argv)

    from glm53_overlay.selfcheck import selfcheck

    # vLLM logs to stdout by default; keep stdout pure JSON for the Ansible module that parses it.
    with contextlib.redirect_stdout(sys.stderr):
        report = selfcheck()
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
