"""Megatron-core integration: run `--moe-token-dispatcher-type flex
--moe-flex-dispatcher-backend deepep|hybridep` on megatron_ep, unchanged Megatron code and flags.

Megatron's `MoEFlexTokenDispatcher` looks `_DeepepManager` / `_HybridEPManager` up as globals of
`megatron.core.transformer.moe.token_dispatcher` each time it is constructed, so `install()`
rebinds those two names to our managers. Activation, any one of:

* `import megatron_ep.megatron; megatron_ep.megatron.install()` (idempotent);
* `import megatron_ep.megatron.activate` (e.g. from a `--spec` module or a launcher);
* `MEGATRON_EP_INSTALL=1` in the environment: importing `megatron_ep.megatron` (which the two
  above, `megatron_ep.megatron.launch` and our experts spec helpers do) installs;
* `torchrun ... -m megatron_ep.megatron.launch pretrain_gpt.py <Megatron-LM args>`.

Install before the model is built: dispatchers constructed earlier keep the managers they got.
`MEGATRON_EP_BACKEND` picks the Buffer backend (see buffers.py). `install()` first checks every
environment variable the managers, their Buffers and chunked experts read later
(`check_environment()`): a bad value is refused there, not at the first dispatch.
"""

from __future__ import annotations

import logging
import sys

from ..core import envs
from . import compat

logger = logging.getLogger(__name__)

_ORIGINALS: dict = {}


def _managers():
    from .deepep_manager import MegatronEPDeepepManager
    from .hybridep_manager import MegatronEPHybridEPManager

    return {"_DeepepManager": MegatronEPDeepepManager, "_HybridEPManager": MegatronEPHybridEPManager}


def check_environment() -> None:
    """Read every variable the flex managers, their Buffers and chunked experts read later,
    through the same readers (ValueError naming the first bad one): MEGATRON_EP_BACKEND,
    MEGATRON_EP_CHECK_INPUTS, MEGATRON_EP_MAX_TOKENS_PER_RANK, MEGATRON_EP_COMBINE_ROWS,
    MEGATRON_EP_RANKS_PER_NODE, MEGATRON_EP_RANK_CAPACITY_FACTOR, MEGATRON_EP_CHUNKED_EXPERTS,
    MEGATRON_EP_GEMM_BACKEND."""
    from ..experts.backends import gemm_backend_from_env
    from . import backend, budget, buffers, chunked

    backend.from_env()
    buffers.cuda_options_from_env()
    budget.factor_from_env()
    chunked.chunks_from_env()
    gemm_backend_from_env()


def install() -> compat.Features:
    """Rebind Megatron's flex managers to megatron_ep's (idempotent); returns what was detected
    about the installed megatron-core. The environment is checked and every probe runs first:
    on any failure nothing is rebound; a bad variable raises ValueError naming it
    (check_environment), an unsupported megatron-core one IncompatibleMegatronError naming the
    version and what did not fit."""
    check_environment()
    feats = compat.check_supported()
    from megatron.core.transformer.moe import token_dispatcher as td

    managers = _managers()  # imported before anything is rebound
    for name, cls in managers.items():
        current = getattr(td, name)
        if current is not cls:
            _ORIGINALS.setdefault(name, current)
    for name, cls in managers.items():
        setattr(td, name, cls)
    logger.info("megatron_ep installed into megatron-core %s (%s)", feats.version, feats)
    return feats


def uninstall() -> None:
    """Restore Megatron's own managers."""
    from megatron.core.transformer.moe import token_dispatcher as td

    for name, cls in _ORIGINALS.items():
        setattr(td, name, cls)
    _ORIGINALS.clear()


def is_installed() -> bool:
    from megatron.core.transformer.moe import token_dispatcher as td

    return all(getattr(td, name) is cls for name, cls in _managers().items())


def __getattr__(name):  # lazy: importing this package must not import megatron-core eagerly
    if name in ("MegatronEPDeepepManager", "MegatronEPHybridEPManager"):
        return _managers()["_DeepepManager" if "Deepep" in name else "_HybridEPManager"]
    raise AttributeError(name)


def _launcher_starting() -> bool:
    """Whether Python imports this package to run `python -m megatron_ep.megatron.launch` (while
    it looks for a -m module, sys.argv[0] is "-m"). The launcher installs anyway, after it has
    checked the environment: a bad MEGATRON_EP_INSTALL is then its one line, not an import
    traceback."""
    return sys.argv[:1] == ["-m"] and f"{__name__}.launch" in getattr(sys, "orig_argv", ())


if not _launcher_starting() and envs.flag("MEGATRON_EP_INSTALL"):
    install()

__all__ = ["check_environment", "install", "uninstall", "is_installed", "compat", "MegatronEPDeepepManager",
           "MegatronEPHybridEPManager"]
