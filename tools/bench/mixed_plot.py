"""The mixed phase's PNG: each decode stream's token rate over time, the long prefill shaded."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _rate_series(points: list[list[float]], bin_s: float) -> tuple[list[float], list[float]]:
    """Tokens per second in consecutive bins, from (time, cumulative tokens) points."""
    if len(points) < 2:
        return [], []
    start, end = points[0][0], points[-1][0]
    xs, ys = [], []
    t, i, last = start, 0, points[0][1]
    while t < end:
        while i < len(points) and points[i][0] <= t + bin_s:
            i += 1
        now = points[i - 1][1]
        xs.append(t + bin_s / 2)
        ys.append((now - last) / bin_s)
        last, t = now, t + bin_s
    return xs, ys


def write_mixed_plot(mixed: Mapping[str, Any], title: str, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = mixed["timeline"]
    span = max((s[-1][0] for s in timeline["streams"] if s), default=1.0)
    bin_s = max(span / 80, 0.05)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, points in enumerate(timeline["streams"]):
        xs, ys = _rate_series(points, bin_s)
        ax.plot(xs, ys, drawstyle="steps-mid", label=f"stream {i}")
    if timeline["long_first_token"] is not None:
        ax.axvspan(timeline["long_sent"], timeline["long_first_token"], color="orange", alpha=0.25,
                   label=f"long prefill ({mixed['long_prompt_tokens']} tokens, TTFT {mixed['long_ttft_s']:.2f} s)")
    if timeline["short_first_token"] is not None:
        ax.annotate(f"short request TTFT {mixed['short_ttft_s']:.2f} s",
                    xy=(timeline["short_first_token"], 0), xytext=(timeline["short_sent"], ax.get_ylim()[1] * 0.9),
                    arrowprops={"arrowstyle": "->"}, fontsize=8)
        ax.axvline(timeline["short_sent"], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("seconds since the phase started")
    ax.set_ylabel(f"decode tokens/s (bins of {bin_s:.2f} s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    rates = mixed["decode_tok_s"]

    def fmt(rate: float | None) -> str:
        return "-" if rate is None else f"{rate:.1f}"

    ax.set_title(f"{title}\nmedian decode tok/s per stream: before {fmt(rates['before'])}, "
                 f"during {fmt(rates['during'])}, after {fmt(rates['after'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
