"""`MEGATRON_EP_BACKEND`: which megatron_ep Buffer backend the flex managers use ("torch",
"cuda", "auto"; unset: "auto"). The one place that reads and checks the variable; standard
library only, so commands can check it before they load torch.

A value that names no backend is an error, never "auto": a typo would otherwise pick a backend
the user did not ask for without a word.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

ENV = "MEGATRON_EP_BACKEND"
BACKENDS = ("torch", "cuda", "auto")


def from_env() -> Optional[str]:
    """The backend the variable names, None when it is unset or empty; ValueError naming the
    variable, its value and the allowed values when it names none."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV}={raw!r} names no backend: use one of {', '.join(BACKENDS)} (or leave it unset: auto)")
    return value


def choose(option: Optional[str], option_name: str) -> Tuple[str, Optional[str]]:
    """A command's own backend option against the variable: (the backend, the line to say when
    the option overrides a different value of the variable, else None). The option wins; without
    it the variable, else "auto". A bad value of the variable is refused even under the option
    (ValueError). Standard library only: recipes/deepseek_v3_ep64/launch.py loads this file by
    its path, where megatron_ep may not be importable."""
    env = from_env()
    if option is None:
        return env or "auto", None
    overridden = None
    if env is not None and env != option:
        overridden = f"{option_name} {option} overrides {ENV}={env} (the command's option wins)"
    return option, overridden


def resolve(option: Optional[str], option_name: str) -> Tuple[str, Optional[str]]:
    """choose(), a bad value of the variable as a command's usage error (one line)."""
    from ..tools.cli import UsageError

    try:
        return choose(option, option_name)
    except ValueError as e:
        raise UsageError(str(e)) from None
