"""``--plot out.png``: latency CDFs per class, throughput and queue over time.

Needs matplotlib (``pip install 'hybridserve[bench]'``); imported only when asked.
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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'hybridserve[bench]'") from None

    reqs = [r for r in report["requests"] if r["ok"]]
    classes = list(report["classes"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, key, title in ((axes[0, 0], "ttft_s", "time to first token"), (axes[0, 1], "e2e_s", "end-to-end latency")):
        for c in classes:
            _cdf(ax, [r[key] for r in reqs if r["request_class"] == c and r[key] is not None], c)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} (CDF per class)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")

    tl = report["timeline"]
    t = np.asarray([p["t"] for p in tl], dtype=float)
    ax = axes[1, 0]
    if len(t) > 1:
        tok = np.asarray([p.get("output_tokens", 0) for p in tl], dtype=float)
        # Tokens per second over windows of ~1/20 of the run (a step-level derivative is noise).
        edges = np.linspace(0.0, t[-1], 21)
        cum = np.interp(edges, t, tok)
        ax.step(edges[1:], np.diff(cum) / np.diff(edges), where="pre", label="output tokens/s")
    ax.axhline(report["overall"]["output_throughput_tok_s"], ls="--", c="gray", label="run average")
    ax.set_xlabel("s since start")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput over time")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")

    ax = axes[1, 1]
    for key, label in (("running", "running requests"), ("waiting", "waiting requests")):
        if any(key in p for p in tl):
            ax.plot(t, [p.get(key, np.nan) for p in tl], label=label, drawstyle="steps-post")
    ax.set_xlabel("s since start")
    ax.set_ylabel("requests")
    ax.set_title("running and waiting over time")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")

    fig.suptitle(f"hybridserve bench {report['mode']}: {report['overall']['completed']} requests, "
                 f"{report['overall']['output_throughput_tok_s']:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
