"""Several ranks on one GPU (virtual ranks): what every such process must set before it starts CUDA.

Under MPS the ranks' kernels run in one shared context. With lazy module loading (CUDA's default
since 12.2; torch sets CUDA_MODULE_LOADING=LAZY where it is unset) a kernel's module is loaded at
its first launch, and that load may wait until the context is idle (CUDA C++ Programming Guide,
"Lazy Loading", potential hazards: concurrent execution). A peer's dispatch or combine kernel
waiting for this rank's next signal keeps the context busy, so this rank's first launch of any
library kernel (a GEMM variant first picked for this batch's token counts, say) waits for that
peer, which waits for this rank: both stop until the handshake timeout. megatron_ep loads its
own kernels when the extension is set up; every other library's must be loaded up front:
CUDA_MODULE_LOADING=EAGER, set before the process initialises CUDA.

One rank per GPU cannot meet this: a rank's context holds only its own kernels, and those wait
only for calls its peers have already made.
"""

from __future__ import annotations

import ctypes
import os
from typing import MutableMapping, Optional

ENV = "CUDA_MODULE_LOADING"
EAGER, LAZY = "EAGER", "LAZY"
_DRIVER_MODES = {1: EAGER, 2: LAZY}  # CUmoduleLoadingMode


def env_mode(environ: Optional[MutableMapping[str, str]] = None) -> str:
    """The loading mode CUDA takes from `environ` when it starts: EAGER only when asked for (unset
    or anything else is lazy, as torch and the driver leave it)."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    return EAGER if value.strip().upper() == EAGER else LAZY


def _driver_mode() -> Optional[str]:
    """The driver's own answer where CUDA is initialised in this process (cuModuleGetLoadingMode),
    else None."""
    try:
        import torch

        if not torch.cuda.is_initialized():
            return None
        mode = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode(ctypes.byref(mode)) != 0:
            return None
        return _DRIVER_MODES.get(mode.value)
    except (OSError, AttributeError, ImportError):
        return None


def module_loading() -> str:
    """EAGER or LAZY: how this process loads CUDA modules (the driver's mode once CUDA is up, else
    what the environment will give it)."""
    return _driver_mode() or env_mode()


def prepare_shared_gpu(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Make this process fit to share its GPU with other ranks: CUDA_MODULE_LOADING=EAGER in
    `environ` (default: this process's), before CUDA starts. Raises RuntimeError where CUDA
    already runs here with lazy loading (too late to change)."""
    environ = os.environ if environ is None else environ
    if environ is os.environ and _driver_mode() == LAZY:
        raise RuntimeError(f"CUDA already runs in this process with lazy module loading: ranks that share a GPU "
                           f"need {ENV}={EAGER} before CUDA starts (set it in the launcher's environment)")
    environ[ENV] = EAGER


def lazy_loading_hazard(ranks_per_device: int, mode: Optional[str] = None) -> Optional[str]:
    """What to tell a user whose ranks share a GPU while modules load lazily (None otherwise)."""
    if ranks_per_device <= 1 or (mode or module_loading()) == EAGER:
        return None
    return (f"{ranks_per_device} ranks share this GPU and CUDA loads modules lazily ({ENV} is not {EAGER}): under "
            f"MPS a rank's first launch of a kernel can wait for a peer's dispatch or combine kernel that waits for "
            f"this rank, until the timeout; start every rank with {ENV}={EAGER} (docs/design.md §5)")
