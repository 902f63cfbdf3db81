"""megatron_ep: expert-parallel dispatch/combine kernels for MoE, with a pure-PyTorch reference
backend of the same API and Megatron-core flex-dispatcher integration."""

import importlib as _importlib
import sys as _sys

# The public names load on first use (PEP 562): `import megatron_ep` and its stdlib-only modules
# (tools.cli) work without torch, so a command run outside the project's environment can say so in
# one line (cli.require) instead of ending in an import traceback.
_PUBLIC = {
    "combine": "core.autograd", "dispatch": "core.autograd",
    "Buffer": "core.buffer", "cuda_backend_available": "core.buffer",
    "BufferBrokenError": "core.errors", "BufferBusyError": "core.errors", "CallMismatchError": "core.errors",
    "CommTimeoutError": "core.errors", "MegatronEPError": "core.errors", "PeerFailedError": "core.errors",
    "PeerFailedFatalError": "core.errors", "WorstCaseOverflowError": "core.errors",
    "per_token_cast_back": "core.fp8", "per_token_cast_to_fp8": "core.fp8",
    "CombineOutput": "core.types", "DispatchHandle": "core.types", "DispatchLayout": "core.types", "DispatchOutput": "core.types",
    "EventOverlap": "core.types", "LowLatencyDispatchOutput": "core.types", "LowLatencyHandle": "core.types",
}


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


# The package by role (docs/design.md, "The package"): modules that moved keep their old dotted
# names, each with a one-line notice, so code and commands written against them keep working.
# One table; the finder below is its only reader.
_MOVED = {
    **{m: f"core.{m}" for m in ("autograd", "buffer", "checks", "envs", "errors", "fp8", "logfmt", "permute",
                                "protocol", "replay", "requests", "types")},
    "hooks": "core.output_hook", "reference": "backends.torch", "cuda": "backends.cuda",
    **{m: f"tools.{m}" for m in ("cli", "demo", "model", "resources", "tracing")},
}


class _MovedName:
    """Finder and loader of a moved module's old name: an import gets the module itself (one
    module object, so its classes stay one class), `python -m` runs the new module as __main__."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        head, _, rest = fullname.partition(".")
        if head != __name__ or not rest:
            return None
        first, _, tail = rest.partition(".")
        if first not in _MOVED:
            return None
        import importlib.machinery

        new = f"{__name__}.{_MOVED[first]}" + (f".{tail}" if tail else "")
        return importlib.machinery.ModuleSpec(fullname, _MovedName(fullname, new))

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def _notice(self) -> None:
        import warnings

        warnings.warn(f"{self.old} is now {self.new}; the old name still works", FutureWarning, stacklevel=3)

    def create_module(self, spec):
        self._notice()
        return _importlib.import_module(self.new)

    def exec_module(self, module):
        pass  # the new module ran when it was imported

    def get_code(self, fullname):  # `python -m OLD`: run NEW as the main module
        self._notice()
        return compile(f"import runpy\nrunpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)",
                       f"<{self.old}>", "exec")

    def is_package(self, fullname):
        return False


# first: an old name's submodules (megatron_ep.cuda.paths.intranode) must not be found again
# through the moved package's __path__ as modules of their own
if _MovedName not in _sys.meta_path:
    _sys.meta_path.insert(0, _MovedName)


__version__ = "0.1.0"

__all__ = list(_PUBLIC)
