"""The argument parser both command-line tools use: a mistyped command or flag is reported by
the parser of the command it was given to (its usage, not the tool's), with the nearest valid
spelling (``did you mean --deep?``); exit status 2, as every usage error."""

from __future__ import annotations

import argparse
import difflib
import re

_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


def _nearest(word: str, candidates) -> str | None:
    found = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose subcommands reject their own unknown flags."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras and self._subcommand():
            self.error(self._unrecognized(extras))
        return ns, extras

    def _subcommand(self) -> bool:
        """Whether this is a subcommand's parser (one with no subcommands of its own)."""
        return not any(isinstance(a, argparse._SubParsersAction) for a in self._actions)

    def _unrecognized(self, extras: list[str]) -> str:
        msg = f"unrecognized arguments: {' '.join(extras)}"
        flags = [s for a in self._actions for s in a.option_strings]
        for arg in extras:
            if arg.startswith("-"):
                near = _nearest(arg.split("=", 1)[0], flags)
                if near is not None:
                    return f"{msg} (did you mean {near}?)"
        return msg

    def error(self, message: str):
        m = _CHOICE.search(message)
        if m is not None:
            near = _nearest(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
            if near is not None:
                message += f"; did you mean {near!r}?"
        super().error(message)
