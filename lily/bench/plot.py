"""The bench plot (matplotlib, the `lily[bench]` extra): prefill and decode tok/s against context, one
line per engine, log-log; a refused row keeps its point, drawn hollow."""

from __future__ import annotations

import matplotlib
from matplotlib.figure import Figure  # no pyplot: no display and no global state
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator


def context_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


PANELS = (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s"))


def draw_throughput(engines: dict[str, list[dict]], title: str):
    """engines: name -> rows (contract.Row as JSON). Returns the matplotlib Figure (two panels)."""
    fig = Figure(figsize=(12.8, 5.6), dpi=100, layout="constrained")
    fig.suptitle(title)
    contexts = sorted({r["context"] for rows in engines.values() for r in rows})
    colours = matplotlib.colormaps["tab10"].colors
    for ax, (key, label) in zip(fig.subplots(1, 2), PANELS):
        ax.set_title(label)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        for j, (name, rows) in enumerate(engines.items()):
            pts = sorted((r["context"], r[key], bool(r.get("refused"))) for r in rows if (r.get(key) or 0) > 0)
            colour = colours[j % len(colours)]
            if not pts:  # still named in the legend, so a peer that did not run is seen
                ax.plot([], [], color=colour, linewidth=2, label=f"{name} (not measured)", gid=f"{name}/line")
                continue
            xs, ys, refused = zip(*pts)
            ax.plot(xs, ys, color=colour, linewidth=2, label=name, gid=f"{name}/line")
            for hollow in (False, True):
                sel = [(x, y) for x, y, r in pts if r == hollow]
                if sel:
                    ax.plot(*zip(*sel), linestyle="none", marker="o", markersize=7, color=colour,
                            markerfacecolor="white" if hollow else colour,
                            gid=f"{name}/{'refused' if hollow else 'accepted'}")
        if contexts:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(contexts))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: context_label(int(round(v)))))
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 else f"{v:g}"))
            ax.grid(True, which="major", alpha=0.3)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(title="hollow: refused row", loc="best")
    return fig


def plot_throughput(path, engines: dict[str, list[dict]], title: str) -> None:
    draw_throughput(engines, title).savefig(path)
