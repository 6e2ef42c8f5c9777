"""docs/configuration.md's option tables equal what the launcher's and the OpenAI front's parsers
give, and every option's `--help` states its default (so neither can drift again)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from splitfuse.launcher import options_doc
from splitfuse.utils.cli_help import DefaultsHelpFormatter, options_markdown

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "configuration.md"


def test_the_docs_tables_equal_the_parsers():
    text = DOC.read_text()
    assert options_doc.regenerate(text) == text, (
        "docs/configuration.md's option tables differ from the parsers: run "
        "`.venv/bin/python -m splitfuse.launcher.options_doc` and review the diff")


@pytest.mark.parametrize("name", sorted(options_doc.SECTIONS))
def test_every_option_is_in_the_docs_table(name):
    parser = options_doc.SECTIONS[name]()
    text = DOC.read_text()
    table = text.split(options_doc.begin_marker(name), 1)[1].split(options_doc.end_marker(name), 1)[0]
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction) and action.option_strings:
            assert f"| `{max(action.option_strings, key=len)}" in table, f"{name}: {action.option_strings}"


def _help_line(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    assert isinstance(formatter, DefaultsHelpFormatter)
    return formatter._expand_help(action)


@pytest.mark.parametrize("name", sorted(options_doc.SECTIONS))
def test_every_option_states_its_default_in_help(name):
    """An option that takes a value and may be left out says what happens then: the value
    (appended by the formatter) or, for an unset default, in words."""
    parser = options_doc.SECTIONS[name]()
    for action in parser._actions:
        takes_value = action.option_strings and action.nargs != 0 and not action.required
        if isinstance(action, (argparse._HelpAction, argparse._AppendAction)) or not takes_value:
            continue
        text = _help_line(parser, action)
        assert "default" in text, f"{name} {action.option_strings}: --help gives no default: {text!r}"
        if action.default not in (None, "") and "%(default)" not in (action.help or ""):
            assert f"(default: {action.default})" in text, text


def test_help_prints_the_values():
    from splitfuse.launcher.cli import _parser

    out = _parser().format_help()
    for fragment in ("(default: 8000)", "(default: 600.0)", "(default: 127.0.0.1)", "(default: 0)"):
        assert fragment in " ".join(out.split()), fragment


def test_a_stale_table_is_rewritten_and_check_fails(tmp_path):
    doc = tmp_path / "configuration.md"
    fresh = options_doc.regenerate(DOC.read_text())
    stale = "\n".join(line for line in fresh.splitlines() if not line.startswith("| `--ready-timeout")) + "\n"
    doc.write_text(stale)
    assert options_doc.main(["--check", str(doc)]) == 1
    assert options_doc.main([str(doc)]) == 0
    assert doc.read_text() == fresh
    assert options_doc.main(["--check", str(doc)]) == 0


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="options:launcher"):
        options_doc.regenerate("# no tables here\n")


def test_table_cells_escape_pipes_and_placeholders():
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--pick", default="a", metavar="X", help="a|b for <name>")
    p.add_argument("--flag", action="store_true", help="on")
    rows = options_markdown(p).splitlines()
    assert rows[2] == "| `--pick X` | `a` | a\\|b for &lt;name&gt; |"
    assert rows[3] == "| `--flag` | — | on |"
