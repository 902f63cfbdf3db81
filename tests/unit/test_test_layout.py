"""The test folders named after packages (cuda/, megatron/, deep_ep/) stay test folders: no
process of the suite can import them as those packages (tests/conftest.py)."""

import importlib.util
import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_test_folder_is_importable_as_a_package():
    for name in sorted(d for d in os.listdir(TESTS) if os.path.isdir(os.path.join(TESTS, d)) and not d.startswith(("_", "."))):
        spec = importlib.util.find_spec(name)
        places = list(spec.submodule_search_locations or []) if spec is not None else []
        inside = [p for p in places if os.path.abspath(p).startswith(TESTS + os.sep)]
        assert not inside, f"`import {name}` finds the test folder {inside} (sys.path holds tests/)"
