"""``buckets fit --plot``: the request-length CDF with the fitted bucket boundaries (PNG).

matplotlib is an optional extra (``inf2-pipeline[plot]``), imported only here. The figure
is drawn with the object-oriented API and the Agg canvas, so no pyplot global state or
display is involved.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

from pipeline._files import atomic_write_bytes
from pipeline.errors import InputError
from pipeline.plan.fit import FitResult


def plot_fit(result: FitResult, lengths: Sequence[int], path: Path, title: str = "") -> None:
    """Write a PNG: above, the CDF of accepted request lengths with the fitted boundaries
    and the baselines (legend); below, the padding share of each fitted bucket's compute."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator
    except ImportError:
        raise InputError(
            "--plot", "matplotlib is not installed", "pip install 'inf2-pipeline[plot]'"
        ) from None

    xs = sorted(n for n in lengths if result.max_len is None or n <= result.max_len)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    pow2, single = result.baselines["pow2"], result.baselines["single"]
    lo = max(min(xs[0], pow2.buckets[0]) / 1.5, 1)
    hi = max(single.buckets[0], pow2.buckets[-1], result.buckets[-1]) * 1.15
    # Approximate pixels per doubling of length, to leave out labels that would collide.
    px = 10 * 110 * 0.86 / math.log2(hi / lo)

    fig = Figure(figsize=(10, 6.4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax, pad = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    ax.set_xscale("log", base=2)
    ax.step(
        [max(xs[0], 1), *[max(x, 1) for x in xs]],
        [0.0, *ys],
        where="post",
        color="black",
        lw=1.6,
        label=f"requests (n = {len(xs):,})",
    )
    for b in pow2.buckets:
        ax.axvline(b, color="0.6", ls=":", lw=1.2)
    ax.plot(
        [],
        [],
        color="0.6",
        ls=":",
        label=f"pow2 baseline, {len(pow2.buckets)} buckets: efficiency {pow2.efficiency:.1%}",
    )
    ax.axvline(
        single.buckets[0],
        color="tab:red",
        ls="--",
        lw=1.2,
        zorder=3,  # above the fitted line it often coincides with
        label=f"single shape ({single.buckets[0]}): efficiency {single.efficiency:.1%}",
    )
    ax.plot(
        [],
        [],
        color="tab:blue",
        lw=2,
        label=f"fitted, {len(result.buckets)} buckets: efficiency {result.efficiency:.1%}",
    )
    for b in result.buckets:
        ax.axvline(b, color="tab:blue", lw=1.8)
        pad.axvline(b, color="tab:blue", lw=0.8, alpha=0.5)

    # Bucket lengths along the top, thinned where boundaries crowd.
    top = ax.secondary_xaxis("top")
    top.set_xticks(result.buckets, labels=_thin(result.buckets, px, 9), rotation=90, fontsize=8)
    top.tick_params(colors="tab:blue", length=3)
    top.xaxis.set_minor_locator(NullLocator())

    # Each bucket's padding share, as a bar spanning the requests it holds.
    left = lo
    for u in result.uses:
        pad.bar(
            left,
            u.padding_share,
            width=u.seq - left,
            align="edge",
            color="tab:blue",
            alpha=0.45,
            edgecolor="tab:blue",
        )
        if math.log2(u.seq / left) * px >= 24:
            pad.text(
                math.sqrt(left * u.seq),
                u.padding_share,
                f"{u.padding_share:.0%}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        left = u.seq
    pad.set_ylim(0, min(1.0, max(u.padding_share for u in result.uses) * 1.35 + 0.02))
    pad.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0%}"))
    pad.set_ylabel("padding share\nof bucket's compute", fontsize=9)
    pad.grid(True, axis="y", alpha=0.3)

    pad.xaxis.set_major_locator(LogLocator(base=2))
    pad.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, 1.01)
    pad.set_xlabel("request length (tokens, log scale)")
    ax.set_ylabel("share of requests ≤ length")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", fontsize=9, framealpha=0.95)
    rejected = f", {result.rejected} rejected (> {result.max_len})" if result.max_len else ""
    fig.suptitle(
        f"{len(result.buckets)} fitted buckets: efficiency {result.efficiency:.1%} "
        f"(pow2 {pow2.efficiency:.1%}, single shape {single.efficiency:.1%})\n"
        f"{title + ', ' if title else ''}multiples of {result.multiple_of}{rejected}",
        fontsize=11,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


def _thin(values: Sequence[int], px_per_doubling: float, min_px: float) -> list[str]:
    """Labels for sorted ``values``, blank where one would overlap the previous label."""
    labels, last = [], None
    for v in values:
        if last is None or math.log2(v / last) * px_per_doubling >= min_px:
            labels.append(str(v))
            last = v
        else:
            labels.append("")
    return labels
