"""Boxes and arrows to SVG: the drawing half of `tools.diagram`, with no Pulumi in it.

What flows through here: a tree of `Box`es (a title, text lines, children side by side or
stacked, the rendered resources each stands for) and the `Edge`s between them -> a layout
(sizes from the text, in a monospace font whose advance is 0.6 em, so no font metrics are
needed) -> one self-contained SVG document, the same bytes for the same input.

Containers may carry their caption below their children (`caption_below`), so that arrows
entering from above meet a border, never text. Every box's `<g>` carries `data-resources`
(the names it stands for) and every arrow's `data-from`/`data-to`/`data-step`: the tests
read the picture through them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from xml.sax.saxutils import escape, quoteattr

FONT = 12  # px
CHAR = 0.6 * FONT  # the advance of a monospace character
LINE = 16  # px per text line
PAD = 10  # inside a box
GAP = 36  # between sibling boxes: room for an arrow and its step badge
LANE = 10  # px between arrows that share a lane

STYLE = """
.box > rect { stroke-width: 1.2; }
.canvas > rect { fill: none; stroke: none; }
.title { font-weight: bold; }
.external > rect { fill: #f5f5f5; stroke: #555; }
.front > rect { fill: #e8f1ff; stroke: #2f5f9e; }
.vpc > rect { fill: #f3faf3; stroke: #3b8a3b; }
.cluster > rect { fill: #f2f6fc; stroke: #2f5f9e; }
.nodes > rect { fill: #ffffff; stroke: #777; }
.gpu > rect { fill: #fff8ee; stroke: #c77700; }
.ray > rect { fill: #f4effa; stroke: #6a3fa0; }
.addon > rect { fill: #fafafa; stroke: #999; }
.obs > rect { fill: #fffbe6; stroke: #b59500; }
.aws > rect { fill: #ffffff; stroke: #d45b07; stroke-dasharray: 4 2; }
.legend > rect { fill: #ffffff; stroke: #ccc; }
.edge path { fill: none; stroke-width: 2; }
.request path { stroke: #b3261e; }
.kv path { stroke: #1f6fb2; stroke-dasharray: 6 3; }
.fallback path { stroke: #555; stroke-dasharray: 6 3; }
.badge circle { stroke: none; }
.request circle { fill: #b3261e; } .kv circle { fill: #1f6fb2; } .fallback circle { fill: #555; }
.badge text { fill: #fff; font-weight: bold; text-anchor: middle; }
"""
COLORS = {"request": "#b3261e", "kv": "#1f6fb2", "fallback": "#555"}


@dataclass(eq=False)
class Box:
    title: str
    lines: list[str] = field(default_factory=list)
    children: list[Box] = field(default_factory=list)
    kind: str = "addon"  # the CSS class: external, front, vpc, cluster, nodes, gpu, ray, addon, obs, aws, legend
    resources: tuple[str, ...] = ()  # the rendered names this box stands for
    key: str = ""  # what edges name it by
    row: bool = False  # children side by side (else stacked)
    caption_below: bool = False  # the title and lines under the children
    spread: bool = False  # a row's children spread over its width, the last at the right
    top: int = 0  # extra room above the children: lanes for arrows
    fill: bool = True  # as wide as its column, as tall as its row (else its own size)
    x: float = 0
    y: float = 0
    w: float = 0
    h: float = 0

    def walk(self) -> list[Box]:
        return [self, *(b for c in self.children for b in c.walk())]


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    step: int  # the number on its badge; the legend explains it
    kind: str  # request, kv or fallback
    route: str  # down (bottom -> top), across (side -> side), lane (side, along a lane, into the top), side
    at: float = 0.35  # where on the source's side it leaves (share of the height)
    gap_of: str = ""  # lane/side: the box whose right edge the arrow passes beside
    lane: int = 0  # lane: which lane above the target's column


def _text_size(b: Box) -> tuple[float, float]:
    lines = ([b.title] if b.title else []) + b.lines
    return max((len(t) * CHAR for t in lines), default=0), len(lines) * LINE


def _measure(b: Box) -> tuple[float, float]:
    tw, th = _text_size(b)
    sizes = [_measure(c) for c in b.children]
    if b.row:
        cw = sum(w for w, _ in sizes) + GAP * max(len(sizes) - 1, 0)
        ch = max((h for _, h in sizes), default=0)
    else:
        cw = max((w for w, _ in sizes), default=0)
        ch = sum(h for _, h in sizes) + GAP * max(len(sizes) - 1, 0)
    between = PAD if th and sizes else 0
    b.w, b.h = max(tw, cw) + 2 * PAD, 2 * PAD + b.top + th + between + ch
    return b.w, b.h


def _place(b: Box, x: float, y: float, w: float, h: float) -> None:
    b.x, b.y, b.w, b.h = x, y, w, h
    if not b.children:
        return
    _, th = _text_size(b)
    between = PAD if th else 0
    cy = y + PAD + b.top + (0 if b.caption_below else th + between)
    ch = h - 2 * PAD - b.top - th - between
    if b.row:
        natural = [c.w for c in b.children]
        gap: float = GAP
        if b.spread and len(natural) > 1:
            gap = GAP + (w - 2 * PAD - sum(natural) - GAP * (len(natural) - 1)) / (len(natural) - 1)
        cx = x + PAD
        for c, cw in zip(b.children, natural, strict=True):
            _place(c, cx, cy, cw, ch if c.fill else c.h)
            cx += cw + gap
    else:
        for c in b.children:
            ch_c = c.h
            _place(c, x + PAD, cy, w - 2 * PAD if c.fill else c.w, ch_c)
            cy += ch_c + GAP


def layout(root: Box) -> None:
    """Size every box from its text and children, then place the tree at the origin."""
    _measure(root)
    _place(root, 0, 0, root.w, root.h)


def _route(e: Edge, boxes: dict[str, Box]) -> list[tuple[float, float]]:
    s, d = boxes[e.src], boxes[e.dst]
    if e.route == "down":
        sx, sy = s.x + min(s.w, d.w) / 2, s.y + s.h
        dx = sx if d.x + 12 <= sx <= d.x + d.w - 12 else d.x + d.w / 2
        mid = sy + GAP / 2
        return [(sx, sy), (sx, mid), (dx, mid), (dx, d.y)] if dx != sx else [(sx, sy), (sx, d.y)]
    if e.route == "across":
        top, bottom = max(s.y, d.y), min(s.y + s.h, d.y + d.h)
        y = top + (bottom - top) * e.at
        return [(s.x + s.w, y), (d.x, y)] if d.x > s.x else [(s.x, y), (d.x + d.w, y)]
    g = boxes[e.gap_of]
    sy = s.y + s.h * e.at
    gx = g.x + g.w + GAP / 2 + (e.lane - 1) * LANE / 2
    if e.route == "side":  # along the gap to the target's height, then into its side
        ty = d.y + d.h / 2
        return [(s.x + s.w, sy), (gx, sy), (gx, ty), (d.x, ty)]
    ly = d.y - PAD - LANE * e.lane  # lane: above the target, inside its container's top room
    tx = d.x + d.w / 2 + LANE * e.lane
    return [(s.x + s.w, sy), (gx, sy), (gx, ly), (tx, ly), (tx, d.y)]


def _badge_at(points: list[tuple[float, float]]) -> tuple[float, float]:
    """The middle of the longest segment."""
    (ax, ay), (bx, by) = max(pairwise(points), key=lambda p: abs(p[0][0] - p[1][0]) + abs(p[0][1] - p[1][1]))
    return (ax + bx) / 2, (ay + by) / 2


def _fmt(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _box_svg(b: Box, out: list[str]) -> None:
    attrs = f" data-resources={quoteattr(' '.join(b.resources))}" if b.resources else ""
    key = f" data-key={quoteattr(b.key)}" if b.key else ""
    out.append(f'<g class="box {b.kind}"{key}{attrs}>')
    out.append(f'<rect x="{_fmt(b.x)}" y="{_fmt(b.y)}" width="{_fmt(b.w)}" height="{_fmt(b.h)}" rx="6"/>')
    _, th = _text_size(b)
    ty = b.y + b.h - PAD - th if b.caption_below and b.children else b.y + PAD + b.top
    texts = ([(b.title, "title")] if b.title else []) + [(t, "line") for t in b.lines]
    for i, (text, cls) in enumerate(texts):
        out.append(
            f'<text class="{cls}" x="{_fmt(b.x + PAD)}" y="{_fmt(ty + (i + 1) * LINE - 4)}">{escape(text)}</text>'
        )
    for c in b.children:
        _box_svg(c, out)
    out.append("</g>")


def _edge_svg(e: Edge, boxes: dict[str, Box], out: list[str]) -> None:
    points = _route(e, boxes)
    d = "M " + " L ".join(f"{_fmt(x)} {_fmt(y)}" for x, y in points)
    bx, by = _badge_at(points)
    out.append(
        f'<g class="edge {e.kind}" data-from={quoteattr(e.src)} data-to={quoteattr(e.dst)} data-step="{e.step}">'
        f'<path d="{d}" marker-end="url(#arrow-{e.kind})"/>'
        f'<g class="badge {e.kind}"><circle cx="{_fmt(bx)}" cy="{_fmt(by)}" r="9"/>'
        f'<text x="{_fmt(bx)}" y="{_fmt(by + 4)}">{e.step}</text></g></g>'
    )


def svg(root: Box, edges: list[Edge], title: str) -> str:
    """The SVG document of `root` (laid out here) and `edges`."""
    layout(root)
    boxes = {b.key: b for b in root.walk() if b.key}
    missing = sorted({k for e in edges for k in (e.src, e.dst, e.gap_of) if k and k not in boxes})
    if missing:
        raise ValueError(f"edges name boxes that do not exist: {missing}")
    w, h = root.w, root.h
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_fmt(w)}" height="{_fmt(h)}" '
        f'viewBox="0 0 {_fmt(w)} {_fmt(h)}" font-family="ui-monospace, SFMono-Regular, Menlo, Consolas, monospace" '
        f'font-size="{FONT}">',
        f"<title>{escape(title)}</title>",
        f"<style>{STYLE}</style>",
        "<defs>",
        *(
            f'<marker id="arrow-{k}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="{c}"/></marker>'
            for k, c in COLORS.items()
        ),
        "</defs>",
        f'<rect width="{_fmt(w)}" height="{_fmt(h)}" fill="#ffffff"/>',
    ]
    _box_svg(root, out)
    for e in edges:
        _edge_svg(e, boxes, out)
    out.append("</svg>")
    return "\n".join(out) + "\n"
