"""`make docs`: the command outputs and the stack diagrams in the docs are generated, and a stale
one fails here."""

from __future__ import annotations

import re

from infra.paths import ROOT
from tools import docs


def test_no_generated_block_is_stale():
    assert docs.stale() == [], "run `make docs` and commit the result"


def test_the_docs_show_the_commands_they_name():
    text = (ROOT / "docs" / "capacity.md").read_text()
    assert "<!-- generated: plan prod -->\n```text\nCapacity plan: stacks/Pulumi.prod.yaml (prod)\n" in text
    costs = (ROOT / "docs" / "self-service.md").read_text()
    assert "# make render STACK=prod\nGPU pools (nodes min/desired/max; totals at max size):" in costs


def test_a_hand_edited_block_is_caught(tmp_path):
    page = (ROOT / "docs" / "capacity.md").read_text()
    edited = page.replace("Fit      ok", "Fit      fine", 1)
    assert edited != page
    path = tmp_path / "capacity.md"
    path.write_text(edited)
    original = docs.ROOT
    try:
        docs.ROOT = tmp_path  # stale() reports paths relative to the root
        assert docs.stale([path]) == ["capacity.md"]
    finally:
        docs.ROOT = original
    assert docs.regenerate(edited, "capacity.md") == page


def test_an_unknown_generator_is_named(tmp_path):
    try:
        docs.regenerate("<!-- generated: nope x -->\nbody\n<!-- /generated -->", "x.md")
    except SystemExit as e:
        assert "unknown generator 'nope'" in str(e)
    else:
        raise AssertionError("an unknown generator must stop make docs")


def test_a_missing_or_stale_diagram_is_caught(tmp_path):
    path = tmp_path / "docs" / "img" / "stack-dev.svg"
    original = docs.ROOT
    try:
        docs.ROOT = tmp_path  # stale() reports paths relative to the root
        assert docs.stale([], {path: "dev"}) == ["docs/img/stack-dev.svg"]  # not drawn yet
        path.parent.mkdir(parents=True)
        picture = docs.gen_diagram("dev")
        path.write_text(picture)
        assert docs.stale([], {path: "dev"}) == []
        path.write_text(picture.replace("g5.xlarge", "g6.xlarge"))  # an instance type the stack does not have
        assert docs.stale([], {path: "dev"}) == ["docs/img/stack-dev.svg"]
    finally:
        docs.ROOT = original


def test_the_shown_diagrams_are_what_make_render_draws(tmp_path):
    from tools import render

    for path, stack in docs.diagram_files().items():
        out = tmp_path / stack
        render.write(render.render(stack, stand_in_secrets=True), out)
        assert path.read_text() == (out / "diagram.svg").read_text(), f"{path.name}: run `make docs`"
    readme = (ROOT / "README.md").read_text()
    assert "](docs/img/stack-prod.svg)" in readme, "the README shows prod's picture"


def test_the_docs_index_lists_every_page_once():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = re.findall(r"\]\(([\w-]+\.md)\)", index)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert sorted(linked) == pages, "docs/README.md: one line per page, each page once"
    assert "](docs/README.md)" in (ROOT / "README.md").read_text(), "the README links the index"


def test_the_docs_name_behaviours_not_issue_numbers():
    # Upstream references keep their repository (ray#41161); a bare number is one of ours.
    ours = re.compile(r"\bissues? \d+\b|(?<![\w/.-])#\d+\b", re.I)
    found = {
        path.relative_to(ROOT).as_posix(): ours.findall(path.read_text())
        for path in [*docs.doc_files(), ROOT / "bench" / "performance.md.in"]
    }
    assert not {k: v for k, v in found.items() if v}


def test_the_readme_is_short_and_its_only_dated_figures_are_the_generated_headline():
    from bench.report import BEGIN, END

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    outside = text[: text.index(BEGIN)] + text[text.index(END) :]
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", outside), "dated figures belong on their pages"
