"""Chart layout helpers for the report: point labels that do not collide, and a check that finds colliding text
and legends drawn over the data (used by the tests on every report figure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MARKER_PX = 5.0  # px: half the side of the box kept free around each point (a scatter marker of size ~28, its edge)
RINGS_PT = (5, 10, 16, 24, 34, 46, 60, 76, 94)  # label distances from the point tried in turn, in points
ANGLES_DEG = (45, 135, 315, 225, 0, 180, 90, 270, 20, 160, 340, 200, 65, 115, 295, 245)


def place_labels(ax: Any, xs: Sequence[float], ys: Sequence[float], labels: Sequence[str], fontsize: float = 6,
                 color: str = "0.15") -> list[Any]:
    """Label each point (xs[i], ys[i]) with labels[i] so that no label overlaps another label, a labelled point
    or the axes' edge: each label takes the first free spot on rings of growing radius around its point (points
    with more neighbours go first) and gets a thin leader line when it sits away from its point.

    Call it after the axes' scales and limits are final and after the figure's layout is done (a later layout
    change moves the points but not the label offsets)."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    px_per_pt = fig.dpi / 72.0
    pts = [tuple(ax.transData.transform((x, y))) for x, y in zip(xs, ys)]
    frame = ax.get_window_extent(renderer)
    frame = Bbox.from_extents(frame.x0 + 2, frame.y0 + 2, frame.x1 - 2, frame.y1 - 2)
    taken = [Bbox.from_extents(x - MARKER_PX, y - MARKER_PX, x + MARKER_PX, y + MARKER_PX) for x, y in pts]
    sizes = []
    for text in labels:
        t = ax.text(0, 0, text, fontsize=fontsize)
        ext = t.get_window_extent(renderer)
        sizes.append((ext.width, ext.height))
        t.remove()
    near = 40.0  # px: what counts as a neighbour when ordering
    order = sorted(range(len(pts)), key=lambda i: -sum(
        1 for j in range(len(pts)) if j != i and math.dist(pts[i], pts[j]) < near))
    out: list[Any] = [None] * len(pts)
    for i in order:
        (px, py), (w, h) = pts[i], sizes[i]
        best = None  # (collisions, ring, spot) of the least bad spot, used when no spot is free
        for ring, r_pt in enumerate(RINGS_PT):
            for a in ANGLES_DEG:
                c, s = math.cos(math.radians(a)), math.sin(math.radians(a))
                dx, dy = r_pt * c, r_pt * s
                ha = "left" if c > 0.3 else "right" if c < -0.3 else "center"
                va = "bottom" if s > 0.3 else "top" if s < -0.3 else "center"
                ax_ = px + dx * px_per_pt
                ay_ = py + dy * px_per_pt
                x0 = ax_ if ha == "left" else ax_ - w if ha == "right" else ax_ - w / 2
                y0 = ay_ if va == "bottom" else ay_ - h if va == "top" else ay_ - h / 2
                box = Bbox.from_extents(x0, y0, x0 + w, y0 + h)
                inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
                hits = sum(1 for b in taken if box.overlaps(b)) + (0 if inside else 100)
                spot = (dx, dy, ha, va, box)
                if best is None or (hits, ring) < best[:2]:
                    best = (hits, ring, spot)
                if hits == 0:
                    break
            if best is not None and best[0] == 0:
                break
        assert best is not None
        dx, dy, ha, va, box = best[2]
        taken.append(box)
        arrow = dict(arrowstyle="-", color="0.45", lw=0.5, shrinkA=0, shrinkB=3) if best[1] >= 1 else None
        # a light box behind the text keeps it readable where it crosses a reference line or a leader line
        ann = ax.annotate(labels[i], (xs[i], ys[i]), xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                          fontsize=fontsize, color=color, arrowprops=arrow, zorder=4,
                          bbox=dict(boxstyle="square,pad=0.05", fc="white", ec="none", alpha=0.75))
        ann.set_in_layout(False)
        out[i] = ann
    return out


def _drawn_texts(fig: Any, renderer: Any) -> list[tuple[str, Any]]:
    """(name, window extent) of every visible non-empty text the figure draws, legends as one box each."""
    from matplotlib.text import Text

    out: list[tuple[str, Any]] = []

    def add(name: str, t: Any) -> None:
        if t is not None and t.get_visible() and t.get_text().strip():
            out.append((f"{name} {t.get_text()[:40]!r}", Text.get_window_extent(t, renderer)))

    for t in fig.texts:  # the suptitle is one of them
        add("figure text", t)
    for lg in fig.legends:
        out.append(("figure legend", lg.get_window_extent(renderer)))
    for k, ax in enumerate(fig.axes):
        if not ax.get_visible():
            continue
        box = ax.get_window_extent(renderer)
        for t in (ax.title, getattr(ax, "_left_title", None), getattr(ax, "_right_title", None)):
            add(f"axes {k} title", t)
        add(f"axes {k} x label", ax.xaxis.label)
        add(f"axes {k} y label", ax.yaxis.label)
        for axis, lo, hi in ((ax.xaxis, box.x0, box.x1), (ax.yaxis, box.y0, box.y1)):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                for lab in (tick.label1, tick.label2):
                    if not (lab.get_visible() and lab.get_text().strip()):
                        continue
                    ext = Text.get_window_extent(lab, renderer)
                    mid = (ext.x0 + ext.x1) / 2 if axis is ax.xaxis else (ext.y0 + ext.y1) / 2
                    if lo - 1 <= mid <= hi + 1:  # ticks outside the view are not drawn
                        out.append((f"axes {k} tick {lab.get_text()!r}", ext))
        for t in ax.texts:
            add(f"axes {k} text", t)
        if ax.get_legend() is not None:
            out.append((f"axes {k} legend", ax.get_legend().get_window_extent(renderer)))
    return out


def layout_problems(fig: Any) -> list[str]:
    """What a reader would see as broken in ``fig``: texts that overlap each other (tick labels, titles, axis
    labels, annotations, legends) and legends drawn over an axes' plotting area (over its data or reference
    lines). Empty when the figure is clean."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = _drawn_texts(fig, renderer)
    problems = []
    pad = 0.5  # px: touching boxes are fine
    for i, (na, a) in enumerate(texts):
        for nb, b in texts[i + 1:]:
            if (min(a.x1, b.x1) - max(a.x0, b.x0) > pad) and (min(a.y1, b.y1) - max(a.y0, b.y0) > pad):
                problems.append(f"{na} overlaps {nb}")
    for name, box in texts:
        if "legend" not in name:
            continue
        for k, ax in enumerate(fig.axes):
            a = ax.get_window_extent(renderer)
            if (min(a.x1, box.x1) - max(a.x0, box.x0) > pad) and (min(a.y1, box.y1) - max(a.y0, box.y0) > pad):
                problems.append(f"{name} sits on axes {k}")
    return problems
