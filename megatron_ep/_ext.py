"""Loads the compiled extension `megatron_ep._C`, if it was built.

Importing it needs the CUDA driver; on a machine without one (the CI machine) the import can
fail even though the extension compiled and linked, so the reason is kept for error messages.
"""

from __future__ import annotations

_module = None
_error: str = ""


def load():
    """Return the extension module, or raise RuntimeError saying why it is unusable."""
    global _module, _error
    if _module is None and not _error:
        try:
            from . import _C  # noqa: F401

            _module = _C
        except ImportError as exc:  # not built, or no driver/libraries here
            _error = f"{type(exc).__name__}: {exc}"
    if _module is None:
        raise RuntimeError(f"megatron_ep._C is not usable ({_error}); build it with `pip install -e .` on a machine with nvcc, or use backend='torch'")
    return _module


def available() -> bool:
    try:
        load()
        return True
    except RuntimeError:
        return False


def import_error() -> str:
    available()
    return _error
