"""Loads the compiled extensions, if they were built: `megatron_ep._C` (the runtime and the
intranode kernels) and `megatron_ep._C_nvshmem` (the NVSHMEM paths: low-latency, and internode's RDMA
domain). Every path gets its extension here.

Importing one needs the CUDA driver (and `_C_nvshmem` NVSHMEM's host library); on a machine without
them (the CI machine) the import can fail even though the extension compiled and linked, so the
reason is kept for error messages.
"""

from __future__ import annotations

import importlib

# The extensions link against torch's libraries (libc10, libtorch), which the dynamic loader
# finds only once torch is loaded, and `import megatron_ep` alone does not load it.
import torch  # noqa: F401


class Extension:
    """One compiled module of the package, imported at its first use; the reason it is unusable
    is kept, and named by every later load."""

    def __init__(self, name: str, remedy: str):
        self.name = name
        self.remedy = remedy  # what the error tells the user to do
        self.module = None
        self.error = ""

    def load(self):
        """The module, or RuntimeError saying why it is unusable."""
        if self.module is None and not self.error:
            try:
                self.module = importlib.import_module(f"megatron_ep.{self.name}")  # built at the package root (setup.py)
            except ImportError as exc:  # not built, or no driver/libraries here
                self.error = f"{type(exc).__name__}: {exc}"
        if self.module is None:
            raise RuntimeError(f"megatron_ep.{self.name} is not usable ({self.error or 'not built'}); {self.remedy}")
        return self.module

    def available(self) -> bool:
        try:
            self.load()
            return True
        except RuntimeError:
            return False


CUDA = Extension("_C", "build it with `pip install -e .` on a machine with nvcc, or use backend='torch'")
NVSHMEM = Extension("_C_nvshmem", "the NVSHMEM paths (low-latency, internode) need it; it is built by setup.py when the "
                             "pip package nvidia-nvshmem-cu13 is installed (pip install nvidia-nvshmem-cu13, then "
                             "rebuild), or use backend='torch'")


def load():
    """`megatron_ep._C`, or RuntimeError saying why it is unusable."""
    return CUDA.load()


def load_nvshmem():
    """`megatron_ep._C_nvshmem`, or RuntimeError saying why it is unusable."""
    return NVSHMEM.load()


def available() -> bool:
    return CUDA.available()


def import_error() -> str:
    CUDA.available()
    return CUDA.error
