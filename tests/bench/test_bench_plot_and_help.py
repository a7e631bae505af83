"""Issue 21's bench items: every ``bench throughput`` option has a description, the
timeline shows requests from the moment they arrive, and no plot legend covers a curve.

Oracles: argparse's own record of each option's help; the workload (every request
arrives at 0, so the engine must report them all waiting before the first step ends);
matplotlib's rendered extents of each legend and its panel's plotting area.
"""

from __future__ import annotations

import json

import pytest

from hybridserve.cli import build_parser, main
from hybridserve.model.tiny import write_tiny_checkpoint


def _throughput_parser():
    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "bench")[1]
    return bench._subparsers._group_actions[0].choices["throughput"]


def test_every_bench_throughput_option_has_a_description():
    undocumented = [a.option_strings for a in _throughput_parser()._actions
                    if a.option_strings and a.option_strings[0] != "-h" and not a.help]
    assert undocumented == []
    for opt in ("--dtype", "--block-size", "--max-num-batched-tokens", "--max-model-len", "--admission-policy",
                "--no-prefix-caching"):
        action = next(a for a in _throughput_parser()._actions if opt in a.option_strings)
        assert len(action.help) > 15, (opt, action.help)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("plot")
    model = str(write_tiny_checkpoint(d / "m", preset="test-a", seed=3))
    out = d / "r.json"
    rc = main(["bench", "throughput", model, "--num-prompts", "12", "--prompt-len", "8-24", "--output-len", "3-8",
               "--max-num-seqs", "4", "--threads", "2", "--output", str(out), "--no-progress"])
    assert rc == 0
    return json.loads(out.read_text())


def test_timeline_shows_arrivals_before_the_first_step(run):
    tl = run["timeline"]
    # Every request arrived at 0: before the first step has allocated a block, a sample
    # already shows all of them in the engine (running + waiting), not the empty engine
    # of before the arrivals (the first step may take seconds).
    first_step_end = min(p["t"] for p in tl if p["kv_blocks_used"] > 0)
    early = [p for p in tl if p["t"] < first_step_end]
    assert any(p["running"] + p["waiting"] == len(run["requests"]) for p in early), tl[:4]


def test_no_legend_covers_a_plotting_area(run, tmp_path):
    from hybridserve.bench.plot import build_figure, write_plot

    fig = build_figure(run)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = 0
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is None:
            continue
        legends += 1
        box, area = leg.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert not box.overlaps(area), (ax.get_title(), box, area)
        # ...and inside the figure, not cut off.
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
    assert legends == 4
    png = tmp_path / "p.png"
    write_plot(run, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
