"""One loop for the test cases that check refusals: each call must raise a given exception whose
message contains a given text (the argument or reason it names)."""

from __future__ import annotations

from typing import Callable, Iterable, Tuple


def refusals(cases: Iterable[Tuple[str, Callable[[], object], type, str]], tag: str = "") -> list:
    """Each case (name, call, exception type, text): the failures as messages, [] when every call
    raised that exception naming its text."""
    errors = []
    for name, call, exc, text in cases:
        try:
            call()
            errors.append(f"{tag}{name}: did not raise {exc.__name__}")
        except exc as e:
            if text not in str(e):
                errors.append(f"{tag}{name}: {exc.__name__} without {text!r}: {e}")
    return errors
