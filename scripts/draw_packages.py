"""Draw the package map (docs/img/packages.png and .svg) from the import graph of the code.

grimp reads every import statement of the six top-level packages (those inside functions too);
each module is collapsed to its package: ``appliance.<room>`` for the appliance's rooms (a
subpackage, or a module at its root such as ``app``), the top-level name for the others. The
layers are the allowed direction of imports, top to bottom: appliance -> tui -> trainer -> store
-> contracts, and harness_adapters -> contracts, imported by the appliance alone. The appliance's
rooms are laid out in rows by their own imports (a room above the rooms it imports).

An arrow is an import between two packages, labelled with the number of (importing module,
imported module) pairs; dashed where every such import is for type checking only; red where it
points against the layers (printed too). The appliance's imports of the packages below it are
drawn from its frame as one arrow each, and listed per room in the room's box.

    .venv/bin/python scripts/draw_packages.py            # writes docs/img/packages.png and .svg
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

ROOT = Path(__file__).resolve().parent.parent

#: The layers below the appliance, top to bottom; harness_adapters stands beside them.
LOWER: tuple[str, ...] = ("tui", "trainer", "store", "contracts")
ADAPTERS = "harness_adapters"
PACKAGES: tuple[str, ...] = ("appliance", *LOWER, ADAPTERS)

Edges = Counter[tuple[str, str]]

BOX_W, BOX_H, ROW_H, COL_W = 2.5, 0.72, 1.55, 3.2


def node_of(module: str) -> str:
    """The package a module is drawn in: ``appliance.<room>`` or its top-level package."""
    parts = module.split(".")
    if parts[0] == "appliance" and len(parts) > 1:
        return f"appliance.{parts[1]}"
    return parts[0]


def package_edges(graph: grimp.ImportGraph) -> Edges:
    """(importer package, imported package) -> the number of module pairs behind it."""
    edges: Edges = Counter()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = node_of(module), node_of(imported)
            if a != b:
                edges[(a, b)] += 1
    return Counter(dict(sorted(edges.items())))


def top(node: str) -> str:
    return node.split(".")[0]


def allowed(a: str, b: str) -> bool:
    """Whether an import from package ``a`` to package ``b`` follows the layers."""
    ta, tb = top(a), top(b)
    if ta == tb:
        return True  # the appliance's rooms among themselves: drawn by their own order
    if tb == ADAPTERS:
        return ta == "appliance"
    if ta == ADAPTERS:
        return tb == "contracts"
    order = ("appliance", *LOWER)
    return ta in order and tb in order and order.index(ta) < order.index(tb)


def components(rooms: list[str], edges: Edges) -> list[list[str]]:
    """The rooms' strongly connected components (rooms importing each other through a cycle),
    importers before the rooms they import (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(r: str) -> None:
        index[r] = low[r] = len(index)
        stack.append(r)
        for o in rooms:
            if not edges.get((r, o)):
                continue
            if o not in index:
                visit(o)
                low[r] = min(low[r], low[o])
            elif o in stack:
                low[r] = min(low[r], index[o])
        if low[r] == index[r]:
            group: list[str] = []
            while True:
                o = stack.pop()
                group.append(o)
                if o == r:
                    break
            found.append(sorted(group))

    for r in rooms:
        if r not in index:
            visit(r)
    return found[::-1]


def room_rows(rooms: list[str], edges: Edges) -> list[list[str]]:
    """Rows of rooms: a room one row below the lowest room importing it; rooms in a cycle share
    a row."""
    groups = components(rooms, edges)
    row_of: dict[str, int] = {}
    for group in groups:  # importers first, so every importer's row is known
        importers = [row_of[o] for o in rooms if o in row_of and any(edges.get((o, r)) for r in group)]
        for r in group:
            row_of[r] = max(importers) + 1 if importers else 0
    rows: list[list[str]] = [[] for _ in range(max(row_of.values(), default=-1) + 1)]
    for r in sorted(rooms):
        rows[row_of[r]].append(r)
    # A few sweeps of the barycentre heuristic to uncross the arrows: each row ordered by the mean
    # x of the rooms it imports or is imported by (x as a share of the frame's width).
    for _sweep in range(8):
        for i, row in enumerate(rows):
            x = {r: (j + 0.5) / len(rw) for rw in rows for j, r in enumerate(rw)}
            key: dict[str, float] = {}
            for r in row:
                linked = [x[o] for o in rooms if row_of[o] != i and (edges.get((o, r)) or edges.get((r, o)))]
                key[r] = sum(linked) / len(linked) if linked else x[r]
            row.sort(key=key.__getitem__)
    return rows


def layout(nodes: Iterable[str], edges: Edges) -> tuple[dict[str, tuple[float, float]], float, float]:
    """Box centres, the appliance frame's width and its bottom edge's y."""
    present = set(nodes)
    rooms = sorted(n for n in present if top(n) == "appliance")
    rows = room_rows(rooms, edges)
    width = max([len(r) for r in rows] + [len(LOWER) + 1]) * COL_W
    centres: dict[str, tuple[float, float]] = {}
    for i, rw in enumerate(rows):
        for j, r in enumerate(rw):
            centres[r] = ((j + 0.5) * width / len(rw), -i * ROW_H)
    frame_bottom = -(len(rows) - 1) * ROW_H - BOX_H / 2 - 0.8
    steps = len(LOWER) + 1
    for i, name in enumerate(LOWER):
        centres[name] = ((i + 0.5) * width / steps, frame_bottom - 0.9 - i * ROW_H)
    centres[ADAPTERS] = ((steps - 0.5) * width / steps, frame_bottom - 0.9)
    return {n: c for n, c in centres.items() if n in present}, width, frame_bottom


def draw_box(ax: Axes, centre: tuple[float, float], title: str, note: list[str], colour: str) -> None:
    x, y = centre
    ax.add_patch(
        FancyBboxPatch(
            (x - BOX_W / 2, y - BOX_H / 2),
            BOX_W,
            BOX_H,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor=colour,
            edgecolor="#333333",
            linewidth=1.0,
            zorder=3,
        )
    )
    lines = ["  ".join(note[i : i + 2]) for i in range(0, len(note), 2)]
    ax.text(x, y + 0.09 * len(lines), title, ha="center", va="center", fontsize=10, weight="bold", zorder=4)
    for i, line in enumerate(lines):
        ax.text(
            x, y - 0.05 - 0.15 * i, line, ha="center", va="center", fontsize=6.2, color="#444444", zorder=4
        )


def draw_arrow(
    ax: Axes,
    start: tuple[float, float],
    end: tuple[float, float],
    count: int,
    *,
    colour: str,
    dashed: bool,
    rad: float,
    at: float = 0.3,
) -> None:
    """An arrow along matplotlib's arc3 curve (a quadratic Bezier), its count a share ``at`` of
    the way along it."""
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=11,
            connectionstyle=f"arc3,rad={rad}",
            color=colour,
            linewidth=0.9,
            linestyle=(0, (4, 3)) if dashed else "solid",
            zorder=2,
            shrinkA=0,
            shrinkB=1,
        )
    )
    (x0, y0), (x1, y1) = start, end
    cx, cy = (x0 + x1) / 2 + rad * (y1 - y0), (y0 + y1) / 2 - rad * (x1 - x0)
    lx = (1 - at) ** 2 * x0 + 2 * at * (1 - at) * cx + at**2 * x1
    ly = (1 - at) ** 2 * y0 + 2 * at * (1 - at) * cy + at**2 * y1
    ax.text(
        lx,
        ly,
        str(count),
        ha="center",
        va="center",
        fontsize=6.5,
        color=colour,
        zorder=5,
        bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
    )


def ports(
    centres: Mapping[str, tuple[float, float]], pairs: list[tuple[str, str]], side: int
) -> dict[tuple[str, str], float]:
    """Spread the arrows leaving (side 0) or entering (side 1) each box along its edge, by the
    other end's x, so that they do not all meet in one point."""
    by_box: dict[str, list[tuple[str, str]]] = {}
    for pair in pairs:
        by_box.setdefault(pair[side], []).append(pair)
    xs: dict[tuple[str, str], float] = {}
    for box, group in by_box.items():
        group.sort(key=lambda p: (centres[p[1 - side]][0], p))
        for i, pair in enumerate(group):
            xs[pair] = centres[box][0] + (i + 1) / (len(group) + 1) * BOX_W * 0.9 - BOX_W * 0.45
    return xs


def draw(edges: Edges, typed_only: set[tuple[str, str]], packages: list[str], out: Path) -> list[str]:
    """Draw the map into ``out`` (.png and .svg); answer the imports against the layers."""
    nodes = {n for pair in edges for n in pair} | {n for n in packages if n != "appliance"}
    centres, width, frame_bottom = layout(nodes, edges)
    edges = Counter({p: n for p, n in edges.items() if p[0] in centres and p[1] in centres})
    rooms = [n for n in centres if top(n) == "appliance"]
    wrong = sorted(f"{a} -> {b} ({n})" for (a, b), n in edges.items() if not allowed(a, b))
    lowest = min(y for _, y in centres.values()) - BOX_H / 2 - 0.5
    top_y = max((centres[r][1] for r in rooms), default=0.0) + BOX_H / 2 + 0.55

    fig, ax = plt.subplots(figsize=((width + 0.6) * 0.85, (top_y - lowest + 0.3) * 0.85))
    ax.set_axis_off()
    ax.set_aspect("equal")
    ax.set_xlim(-0.3, width + 0.3)
    ax.set_ylim(lowest - 0.1, top_y + 0.2)
    ax.add_patch(
        FancyBboxPatch(
            (-0.15, frame_bottom),
            width + 0.3,
            top_y - frame_bottom,
            boxstyle="round,pad=0.02,rounding_size=0.2",
            facecolor="#f4f7fb",
            edgecolor="#4a6fa5",
            linewidth=1.4,
            zorder=0,
        )
    )
    ax.text(0.05, top_y - 0.25, "appliance", fontsize=12, weight="bold", color="#4a6fa5", va="center")

    colours = {
        "tui": "#e8f1e4",
        "trainer": "#fdf0dc",
        "store": "#f3e5f5",
        "contracts": "#eeeeee",
        ADAPTERS: "#e0f2f1",
    }
    for room in rooms:
        below = sorted((b, n) for (a, b), n in edges.items() if a == room and top(b) != "appliance")
        draw_box(
            ax, centres[room], room.removeprefix("appliance."), [f"{b} {n}" for b, n in below], "#dbe6f4"
        )
    for name in (*LOWER, ADAPTERS):
        if name in centres:
            draw_box(ax, centres[name], name, [], colours[name])

    # Arrows between boxes; the appliance's imports of the packages below it are drawn from its frame.
    drawn = [p for p in edges if not (top(p[0]) == "appliance" and top(p[1]) != "appliance")]
    down = [p for p in drawn if centres[p[0]][1] > centres[p[1]][1] + 1e-6]
    level = [p for p in drawn if abs(centres[p[0]][1] - centres[p[1]][1]) < 1e-6]
    up = [p for p in drawn if p not in down and p not in level]
    out_x, in_x = ports(centres, down, 0), ports(centres, down, 1)
    for a, b in sorted(down):
        span = round((centres[a][1] - centres[b][1]) / ROW_H)
        (xa, ya), (xb, yb) = centres[a], centres[b]
        rad = 0.0
        if span > 1:  # past the rows between: bow outward, away from the middle
            outward = 1.0 if (xa + xb) / 2 < width / 2 or (abs(xa - xb) < 0.5 and len(a) % 2) else -1.0
            rad = outward * min(0.3, 0.07 * span) if top(a) == "appliance" else 0.42
        draw_arrow(
            ax,
            (out_x[(a, b)], ya - BOX_H / 2),
            (in_x[(a, b)], yb + BOX_H / 2),
            edges[(a, b)],
            colour="#333333" if allowed(a, b) else "#c62828",
            dashed=(a, b) in typed_only,
            rad=rad,
        )
    for a, b in sorted(level):  # rooms in one cycle: left to right over the boxes, back under them
        (xa, y), (xb, _) = centres[a], centres[b]
        side = 1.0 if xa < xb else -1.0
        draw_arrow(
            ax,
            (xa + side * BOX_W * 0.2, y + side * BOX_H / 2),
            (xb - side * BOX_W * 0.2, y + side * BOX_H / 2),
            edges[(a, b)],
            colour="#e65100",
            dashed=(a, b) in typed_only,
            rad=-0.3 * (1 + abs(xb - xa) / COL_W) / abs(xb - xa),
            at=0.5,
        )
    for a, b in sorted(up):
        (xa, ya), (xb, yb) = centres[a], centres[b]
        draw_arrow(
            ax,
            (xa, ya + BOX_H / 2),
            (xb, yb - BOX_H / 2),
            edges[(a, b)],
            colour="#c62828" if not allowed(a, b) else "#e65100",
            dashed=(a, b) in typed_only,
            rad=0.15,
        )
    for name in (*LOWER, ADAPTERS):
        total = sum(n for (a, b), n in edges.items() if top(a) == "appliance" and b == name)
        if name in centres and total:
            x, y = centres[name]
            draw_arrow(
                ax, (x, frame_bottom), (x, y + BOX_H / 2), total, colour="#4a6fa5", dashed=False, rad=0.0
            )

    legend = (
        "An arrow: imports from one package into another, labelled with the number of (importing module, "
        "imported module) pairs. Blue: the appliance's rooms together (each room lists its own in its box).\n"
        "Dashed: for type checking only. Orange: rooms that import each other through a cycle (one row). "
        "Red: against the layers appliance > tui > trainer > store > contracts, harness_adapters > contracts."
    )
    ax.text(-0.15, lowest + 0.1, legend, fontsize=7, color="#555555", va="center")
    plt.rcParams["svg.hashsalt"] = "packages"
    fig.savefig(out.with_suffix(".png"), dpi=130, metadata={"Software": None}, bbox_inches="tight")
    fig.savefig(out.with_suffix(".svg"), metadata={"Date": None, "Creator": None}, bbox_inches="tight")
    plt.close(fig)
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs/img/packages.png", help="the PNG (an SVG beside it)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    present = [p for p in PACKAGES if (ROOT / p / "__init__.py").exists()]
    graph = grimp.build_graph(*present, cache_dir=None)
    runtime = grimp.build_graph(*present, exclude_type_checking_imports=True, cache_dir=None)
    edges = package_edges(graph)
    at_runtime = package_edges(runtime)
    typed_only = {p for p in edges if not at_runtime.get(p)}
    wrong = draw(edges, typed_only, present, args.out)
    for (a, b), n in sorted(edges.items()):
        flag = "" if allowed(a, b) else "   AGAINST THE LAYERS"
        print(f"{a:24} -> {b:24} {n:3}{' (type checking only)' if (a, b) in typed_only else ''}{flag}")
    print(f"wrote {args.out.with_suffix('.png')} and {args.out.with_suffix('.svg')}")
    if wrong:
        print("imports against the layers: " + ", ".join(wrong))


if __name__ == "__main__":
    main()
