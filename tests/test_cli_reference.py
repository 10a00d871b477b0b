"""docs/cli.md is what p2ptrain/cli/reference.py renders from the parser: a stale reference fails here."""

from p2ptrain.cli import reference
from p2ptrain.cli.main import build_parser


def test_docs_cli_md_is_the_parsers_help():
    parser = build_parser()
    rendered = reference.render(parser)
    current = reference.DOC_PATH.read_text()
    assert current == rendered, f"docs/cli.md is stale: run {reference.REGENERATE}"
    # Every command the parser knows has its own section (the index and the file cannot skip one).
    progs = [p.prog for p in reference.commands(parser)]
    assert len(progs) > 20 and len(set(progs)) == len(progs)
    for prog in progs:
        assert f"\n## {prog}\n" in current


def test_a_new_flag_makes_the_reference_stale():
    parser = build_parser()
    before = reference.render(parser)
    node = next(p for p in reference.commands(parser) if p.prog == "p2ptrain node status")
    node.add_argument("--brand-new-flag", help="something a later change adds")
    after = reference.render(parser)
    assert after != before and "--brand-new-flag" in after
    assert "something a later change adds" in after


def test_help_is_wrapped_at_a_fixed_width_whatever_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = reference.render(build_parser())
    monkeypatch.setenv("COLUMNS", "200")
    assert reference.render(build_parser()) == narrow
