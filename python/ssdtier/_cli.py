"""What every ssdtier command shares: its help format, argument types, and the name of
where typed values come from in errors."""

from __future__ import annotations

import argparse

CLI = "command line"  # the source named in errors of what was typed


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, where it has one (a flag's is off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def positive(text: str) -> int:
    """An argument type: an integer > 0."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n
