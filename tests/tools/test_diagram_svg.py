"""The drawing half of the stack diagram: a box holds its text and its children, siblings do not
overlap, arrows join the boxes they name, and the same input gives the same bytes (the docs'
copies are checked byte for byte by `python -m tools.docs --check`)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from tools.diagram_svg import CHAR, Box, Edge, layout, svg

SVG = "{http://www.w3.org/2000/svg}"


def _tree() -> tuple[Box, list[Edge]]:
    a = Box("Ray head (llm)", ["HAProxy on :8000", "OpenAI ingress x2-4: keys, limits, routing"], kind="ray", key="a")
    b = Box("Ray workers: decode", ["a much longer line than the title of this box"], kind="ray", key="b")
    c = Box("Ray workers: prefill", ["short"], kind="ray", key="c")
    pools = [
        Box("system nodes", ["m7i.2xlarge"], [a, Box("add-ons", ["kuberay-operator 1.7.0"])], caption_below=True),
        Box("decode nodes", ["g5.xlarge"], [b], kind="gpu", caption_below=True, top=20),
        Box("prefill nodes", ["g5.xlarge"], [c], kind="gpu", caption_below=True, top=20),
    ]
    top = Box(
        "", row=True, spread=True, kind="canvas", children=[Box("clients", key="clients"), Box("provider", key="p")]
    )
    root = Box("", kind="canvas", children=[top, Box("cluster", children=[Box("", row=True, children=pools)])])
    edges = [
        Edge("clients", "a", 1, "request", "down"),
        Edge("a", "b", 3, "request", "across"),
        Edge("b", "c", 4, "request", "across", at=0.3),
        Edge("c", "b", 5, "kv", "across", at=0.7),
        Edge("a", "c", 3, "request", "lane", gap_of="a", lane=1),
        Edge("a", "p", 6, "fallback", "side", gap_of="a"),
    ]
    return root, edges


def _inside(inner: Box, outer: Box) -> bool:
    return (
        outer.x <= inner.x
        and inner.x + inner.w <= outer.x + outer.w
        and outer.y <= inner.y
        and inner.y + inner.h <= outer.y + outer.h
    )


def test_each_box_holds_its_text_and_its_children_and_siblings_do_not_overlap():
    root, _ = _tree()
    layout(root)
    for box in root.walk():
        for text in [box.title, *box.lines]:
            assert len(text) * CHAR <= box.w - 2 * 10 + 1e-6, f"{text!r} runs out of its box"
        for child in box.children:
            assert _inside(child, box), f"{child.title!r} sticks out of {box.title!r}"
        for i, one in enumerate(box.children):
            for other in box.children[i + 1 :]:
                apart = (
                    one.x + one.w <= other.x
                    or other.x + other.w <= one.x
                    or one.y + one.h <= other.y
                    or other.y + other.h <= one.y
                )
                assert apart, f"{one.title!r} overlaps {other.title!r}"


def test_a_row_of_columns_is_as_tall_as_its_tallest_and_a_spread_row_ends_at_the_right():
    root, _ = _tree()
    layout(root)
    top, cluster = root.children
    pools = cluster.children[0].children
    assert len({p.h for p in pools}) == 1  # captions below line up
    clients, provider = top.children
    assert clients.x == top.x + 10 and provider.x + provider.w == pytest.approx(top.x + top.w - 10)


def test_every_arrow_joins_the_boxes_it_names():
    root, edges = _tree()
    doc = ET.fromstring(svg(root, edges, "t"))
    boxes = {b.key: b for b in root.walk() if b.key}
    for g in doc.iter(f"{SVG}g"):
        if not g.get("data-step"):
            continue
        src, dst = boxes[g.get("data-from")], boxes[g.get("data-to")]
        nums = [float(v) for v in g.find(f"{SVG}path").get("d").replace("M", "").replace("L", "").split()]
        (sx, sy), (ex, ey) = (nums[0], nums[1]), (nums[-2], nums[-1])

        def on_edge(x, y, b):
            on_x = b.x - 0.1 <= x <= b.x + b.w + 0.1 and (abs(y - b.y) < 0.1 or abs(y - b.y - b.h) < 0.1)
            on_y = b.y - 0.1 <= y <= b.y + b.h + 0.1 and (abs(x - b.x) < 0.1 or abs(x - b.x - b.w) < 0.1)
            return on_x or on_y

        assert on_edge(sx, sy, src) and on_edge(ex, ey, dst), f"arrow {g.get('data-step')} misses its boxes"


def test_an_arrow_to_a_box_that_is_not_drawn_is_refused():
    root, _ = _tree()
    with pytest.raises(ValueError, match="nowhere"):
        svg(root, [Edge("a", "nowhere", 1, "request", "down")], "t")


def test_the_same_boxes_give_the_same_bytes_and_text_is_escaped():
    one, edges = _tree()
    two, _ = _tree()
    one.children[0].children[0].lines.append("a < b & c")
    two.children[0].children[0].lines.append("a < b & c")
    assert svg(one, edges, "t") == svg(two, edges, "t")
    assert "a &lt; b &amp; c" in svg(one, edges, "t")
