"""megatron_ep: expert-parallel dispatch/combine kernels for MoE, with a pure-PyTorch reference
backend of the same API and Megatron-core flex-dispatcher integration."""

from .autograd import combine, dispatch
from .buffer import Buffer, cuda_backend_available
from .errors import (BufferBrokenError, BufferBusyError, CallMismatchError, CommTimeoutError, MegatronEPError, PeerFailedError,
                     PeerFailedFatalError)
from .fp8 import per_token_cast_back, per_token_cast_to_fp8
from .types import (
    CombineOutput,
    DispatchHandle,
    DispatchLayout,
    DispatchOutput,
    EventOverlap,
    LowLatencyDispatchOutput,
    LowLatencyHandle,
)

__version__ = "0.1.0"

import os as _os

if _os.environ.get("MEGATRON_EP_INSTALL") == "1":  # a launcher can activate the Megatron plugin by env
    from . import megatron as _megatron  # noqa: F401  (importing it installs, see megatron_ep/megatron)

__all__ = [
    "Buffer",
    "BufferBrokenError",
    "BufferBusyError",
    "CallMismatchError",
    "CommTimeoutError",
    "MegatronEPError",
    "PeerFailedError",
    "PeerFailedFatalError",
    "CombineOutput",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchOutput",
    "EventOverlap",
    "LowLatencyDispatchOutput",
    "LowLatencyHandle",
    "combine",
    "cuda_backend_available",
    "dispatch",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
]
