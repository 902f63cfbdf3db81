"""Our extension libraries share no object through the loader. The loader merges every
STB_GNU_UNIQUE symbol of the same name across the libraries of a process, also those loaded
RTLD_LOCAL as Python extensions are. An inline function's static of a hidden type (a pybind11
object) gets a library-local object but a unique guard: the second library to call it finds the
guard set by the first and uses an object it never constructed (an unordered_map with no buckets
divides by zero: SIGFPE). So no symbol of ours may be unique in any of them (csrc/intranode/calls.h)."""

import importlib.util
import shutil
import subprocess

import pytest

LIBRARIES = ["megatron_ep._protocol", "megatron_ep._C", "megatron_ep._C_nvshmem"]


def _unique_symbols(path: str) -> list:
    out = subprocess.run(["nm", "-C", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if len(line.split(None, 2)) == 3 and line.split(None, 2)[1] == "u"]


@pytest.mark.parametrize("name", LIBRARIES)
def test_no_symbol_of_ours_is_unique_across_libraries(name):
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        pytest.skip(f"{name} is not built here")
    if shutil.which("nm") is None:
        pytest.skip("binutils' nm is not installed")
    ours = [line for line in _unique_symbols(spec.origin) if "mep::" in line]
    assert not ours, (f"{name} has unique (STB_GNU_UNIQUE) symbols of ours, which the loader would share with "
                      "our other libraries: give each internal linkage (static, or a namespace-scope constexpr):\n"
                      + "\n".join(ours))
