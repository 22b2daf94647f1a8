"""The benchmark's PNG: tok/s against concurrency per phase, and draft acceptance by position."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _title(report: Mapping[str, Any]) -> str:
    spec = report["server"].get("spec_config") or {}
    mode = (f"{spec.get('method')} k={spec.get('num_speculative_tokens')}" if spec
            else "spec decode on" if report["server"]["spec_decode_metrics"] else "no spec decode")
    settings = report["settings"]
    return (f"{report['target']['model']} ({mode}), {settings['runs']} runs x "
            f"{settings['max_tokens']} tokens, {report['created_utc']}")


def write_decode_plot(report: Mapping[str, Any], path: Path) -> Path:
    # Imported here: matplotlib costs a second or two, which a failed /health check should not pay.
    import matplotlib
    matplotlib.use("Agg")  # no display on controllers and CI
    import matplotlib.pyplot as plt

    fig, (speed, accept) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    concurrency_ticks: set[int] = set()
    for i, phase in enumerate(report["phases"]):
        color = colors[i % len(colors)]
        xs = [lvl["concurrency"] for lvl in phase["levels"]]
        concurrency_ticks.update(xs)
        decode = [lvl["summary"]["decode_tok_s"]["median"] for lvl in phase["levels"]]
        aggregate = [lvl["aggregate_tok_s"] for lvl in phase["levels"]]
        # None becomes NaN so a failed cell leaves a gap instead of breaking the line.
        speed.plot(xs, [float("nan") if v is None else v for v in decode], "o-", color=color,
                   label=f"{phase['name']} decode (median per stream)")
        speed.plot(xs, [float("nan") if v is None else v for v in aggregate], "s--", color=color,
                   label=f"{phase['name']} aggregate")
    speed.set_xlabel("concurrent streams")
    speed.set_ylabel("tokens/s")
    speed.set_xticks(sorted(concurrency_ticks))
    speed.set_ylim(bottom=0)
    speed.grid(alpha=0.3)
    speed.legend(fontsize=8)
    speed.set_title("decode speed")

    with_spec = [p for p in report["phases"] if p["spec_decode"] and p["spec_decode"]["per_position"]]
    if with_spec:
        width = 0.8 / len(with_spec)
        for i, phase in enumerate(with_spec):
            rows = phase["spec_decode"]["per_position"]
            offset = (i - (len(with_spec) - 1) / 2) * width
            length = phase["spec_decode"]["mean_acceptance_length"]
            label = phase["name"] + (f" (mean length {length:.2f})" if length is not None else "")
            accept.bar([r["position"] + offset for r in rows], [r["rate"] or 0.0 for r in rows], width,
                       color=colors[report["phases"].index(phase) % len(colors)], label=label)
        accept.set_xlabel("draft position")
        accept.set_ylabel("acceptance rate")
        accept.set_ylim(0, 1)
        accept.set_xticks(sorted({r["position"] for p in with_spec for r in p["spec_decode"]["per_position"]}))
        accept.grid(alpha=0.3, axis="y")
        accept.legend(fontsize=8)
    else:
        accept.axis("off")
        accept.text(0.5, 0.5, "no speculative-decoding counters in /metrics\n(spec decode off, or not vLLM)",
                    ha="center", va="center", fontsize=11)
    accept.set_title("draft acceptance by position")

    fig.suptitle(_title(report), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
