"""The package by role (docs/design.md §3.0): every module that moved keeps its old dotted name.
Importing it gives the very module of the new name with one FutureWarning naming both, a name
inside it is the same object, and `python -m` with an old name runs the new module."""

import importlib
import os
import subprocess
import sys
import warnings

import pytest

import megatron_ep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("old", sorted(megatron_ep._MOVED))
def test_old_name_is_the_new_module(old):
    new = importlib.import_module(f"megatron_ep.{megatron_ep._MOVED[old]}")
    sys.modules.pop(f"megatron_ep.{old}", None)  # (an earlier test may have imported it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"megatron_ep.{old}")
    assert module is new
    notices = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert notices == [f"megatron_ep.{old} is now {new.__name__}; the old name still works"], notices


def test_old_submodule_is_the_new_one():
    """A module under a moved package, by its old name: the same module, not a second copy run
    under the old name (whose relative imports would reach past the package)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from megatron_ep.cuda.paths.intranode import IntranodePath as old
    from megatron_ep.backends.cuda.paths.intranode import IntranodePath as new

    assert old is new


def test_unmoved_and_unknown_names():
    assert importlib.util.find_spec("megatron_ep.megatron") is not None  # not moved: found as it is
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("megatron_ep.no_such_module")


def test_python_m_old_name_runs_the_new_module():
    out = subprocess.run([sys.executable, "-m", "megatron_ep.demo", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m megatron_ep.tools.demo" in out.stdout
    assert "megatron_ep.demo is now megatron_ep.tools.demo" in out.stderr
