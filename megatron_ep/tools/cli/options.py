"""Option parsing: option types that hold their range, a parser that reports one line (megatron_ep.tools.cli)."""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Callable, Optional

from .failures import DEBUG_ENV, _report

# ------------------------------------------------------------------------- option types
# The type and range of an option live in its add_argument(type=...): argparse applies them to
# every value given, before main() runs, and a bad one is one line naming the option
# ("argument --lr: must be a finite number > 0, got 'inf'").
def integer(minimum: int = 1, maximum: Optional[int] = None) -> Callable[[str], int]:
    """argparse type: an int in [minimum, maximum]."""
    wanted = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {wanted}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {wanted}, got {value}")
        return value

    parse.bounds = (minimum, maximum)  # read by the tests that every numeric option is bounded
    return parse


def number(minimum: float = 0.0, *, above: bool = False) -> Callable[[str], float]:
    """argparse type: a finite float >= minimum (> minimum with above=True). float() alone
    takes "nan" and "inf", which no option of ours means."""
    wanted = f"{'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {wanted}, got {text!r}")
        return value

    parse.bounds = (float(minimum), None)
    return parse


# --------------------------------------------------------------------------------- parsing
class HelpFormatter(argparse.HelpFormatter):
    """Descriptions of several lines as written (one line: wrapped); `(default: X)` after every
    option that has a default, unless its help already says its default ("(default ...")."""

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        text = action.help or ""
        # `is`, not `in`: a default of 0 equals False and is still shown
        if ("%(default)" in text or re.search(r"\(default\b", text) or not action.option_strings or action.nargs == 0
                or action.default is None or action.default is False or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors, defaults in --help and a --debug flag."""

    def __init__(self, *args, debug: bool = True, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        if debug:
            self.add_argument("--debug", action="store_true",
                              help=f"on a failure, print the full traceback (or set {DEBUG_ENV}=1)")

    def error(self, message):  # argparse's version prints the whole usage first
        _report(f"{self.prog}: error: {message} (--help lists the options)", usage=True)
        sys.exit(2)
