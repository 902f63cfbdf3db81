"""megatron_ep: expert-parallel dispatch/combine kernels for MoE, with a pure-PyTorch reference
backend of the same API and Megatron-core flex-dispatcher integration."""

import importlib as _importlib

# The public names load on first use (PEP 562): `import megatron_ep` and its stdlib-only modules
# (cli) work without torch, so a command run outside the project's environment can say so in
# one line (cli.require) instead of ending in an import traceback.
_PUBLIC = {
    "combine": "autograd", "dispatch": "autograd",
    "Buffer": "buffer", "cuda_backend_available": "buffer",
    "BufferBrokenError": "errors", "BufferBusyError": "errors", "CallMismatchError": "errors",
    "CommTimeoutError": "errors", "MegatronEPError": "errors", "PeerFailedError": "errors",
    "PeerFailedFatalError": "errors", "WorstCaseOverflowError": "errors",
    "per_token_cast_back": "fp8", "per_token_cast_to_fp8": "fp8",
    "CombineOutput": "types", "DispatchHandle": "types", "DispatchLayout": "types", "DispatchOutput": "types",
    "EventOverlap": "types", "LowLatencyDispatchOutput": "types", "LowLatencyHandle": "types",
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


__version__ = "0.1.0"

__all__ = list(_PUBLIC)
