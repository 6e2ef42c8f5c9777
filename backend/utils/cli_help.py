"""Command-line help that states every default, and the same facts as a Markdown table (the
docs' option tables are generated from the parsers, so they cannot drift from `--help`)."""

from __future__ import annotations

import argparse

NO_DEFAULT = "—"


def shows_default(action: argparse.Action) -> bool:
    """Whether the value of the default is worth printing: None, False, "" and [] mean "not
    given", which the help then says in words (e.g. "default: a temporary directory")."""
    unset = action.default is None or action.default is False or action.default in ([], "", argparse.SUPPRESS)
    if action.required or unset:
        return False
    return action.nargs != 0  # a flag's default is "off"


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's own line breaks and appends "(default: X)" to an option's help
    unless the help places %(default)s itself or there is no value worth printing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if shows_default(action) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _cell(text: str) -> str:
    """One table cell: one line, its pipes escaped, <placeholders> shown rather than read as HTML."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`-- {action.metavar or action.dest.upper()}`"
    name = max(action.option_strings, key=len)
    if action.nargs == 0:
        return f"`{name}`"
    return f"`{name} {action.metavar or action.dest.upper()}`"


def options_markdown(parser: argparse.ArgumentParser) -> str:
    """A Markdown table of the parser's options: option, default, what it does (the help text
    with %(default)s filled in, as `--help` prints it)."""
    rows = ["| Option | Default | Meaning |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        required = action.required and action.nargs not in ("*", "?")  # argparse marks some such positionals
        default = "required" if required else (f"`{action.default}`" if shows_default(action) else NO_DEFAULT)
        meaning = (action.help or "") % {**vars(action), "prog": parser.prog}
        rows.append(f"| {_option(action)} | {default} | {_cell(meaning)} |")
    return "\n".join(rows) + "\n"
