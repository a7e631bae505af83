"""``--plot out.png``: latency CDFs per class, throughput and queue over time.

Needs matplotlib (``pip install 'hybridserve[bench]'``); imported only when asked.
Every legend sits below its panel, outside the plotting area, so that no legend can
cover a curve whatever its shape (constrained layout makes room for them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridserve.errors import ConfigError


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values) * 1e3)
    x = np.concatenate([x[:1], x])
    ax.step(x, np.arange(len(x)) / (len(x) - 1), where="post", label=label)


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    fig = build_figure(report)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_figure(report: dict[str, Any]) -> Any:
    """The four panels as a matplotlib figure (Agg backend)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'hybridserve[bench]'") from None

    reqs = [r for r in report["requests"] if r["ok"]]
    classes = list(report["classes"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), layout="constrained")

    def legend(ax: Any) -> None:
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=min(4, len(handles)), frameon=False)

    for ax, key, title in ((axes[0, 0], "ttft_s", "time to first token"), (axes[0, 1], "e2e_s", "end-to-end latency")):
        for c in classes:
            _cdf(ax, [r[key] for r in reqs if r["request_class"] == c and r[key] is not None], c)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} (CDF per class)")
        ax.grid(alpha=0.3)
        legend(ax)

    tl = report["timeline"]
    t = np.asarray([p["t"] for p in tl], dtype=float)
    ax = axes[1, 0]
    if len(t) > 1:
        tok = np.asarray([p.get("output_tokens", 0) for p in tl], dtype=float)
        # Tokens per second over windows of ~1/20 of the run (a step-level derivative is noise).
        edges = np.linspace(0.0, t[-1], 21)
        cum = np.interp(edges, t, tok)
        # One bar per window, from 0 (a step plot of the right edges started at the
        # first window's end).
        ax.stairs(np.diff(cum) / np.diff(edges), edges, label="output tokens/s", linewidth=1.5)
    ax.axhline(report["overall"]["output_throughput_tok_s"], ls="--", c="gray", label="run average")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput over time")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    legend(ax)

    ax = axes[1, 1]
    # The client's own count, exact at every instant from each request's arrival and
    # end: the server's samples come only between steps (the first may be seconds in).
    done = [r for r in report["requests"] if r.get("e2e_s") is not None]
    if done:
        events = sorted([(r["arrival_time"], 1) for r in done] + [(r["arrival_time"] + r["e2e_s"], -1) for r in done])
        times = np.asarray([0.0] + [e[0] for e in events])
        counts = np.concatenate([[0], np.cumsum([e[1] for e in events])])
        ax.plot(times, counts, drawstyle="steps-post", ls=":", c="gray", label="in flight (client)")
    for key, label in (("running", "running requests"), ("waiting", "waiting requests")):
        if any(key in p for p in tl):
            ax.plot(t, [p.get(key, np.nan) for p in tl], label=label, drawstyle="steps-post")
    ax.set_xlabel("s since start")
    ax.set_ylabel("requests")
    ax.set_title("requests in flight, running and waiting")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    legend(ax)

    fig.suptitle(f"hybridserve bench {report['mode']}: {report['overall']['completed']} requests, "
                 f"{report['overall']['output_throughput_tok_s']:.1f} output tok/s")
    return fig
