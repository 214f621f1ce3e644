"""`make docs`: the command outputs in the docs are generated, and a stale one fails here."""

from __future__ import annotations

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
