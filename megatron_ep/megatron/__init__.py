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
`MEGATRON_EP_BACKEND` picks the Buffer backend (see buffers.py).
"""

from __future__ import annotations

import logging

from .. import envs
from . import compat

logger = logging.getLogger(__name__)

_ORIGINALS: dict = {}


def _managers():
    from .deepep_manager import MegatronEPDeepepManager
    from .hybridep_manager import MegatronEPHybridEPManager

    return {"_DeepepManager": MegatronEPDeepepManager, "_HybridEPManager": MegatronEPHybridEPManager}


def install() -> compat.Features:
    """Rebind Megatron's flex managers to megatron_ep's (idempotent); returns what was detected
    about the installed megatron-core. Every probe runs first: on any failure nothing is
    rebound and one IncompatibleMegatronError names the version and what did not fit."""
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


if envs.flag("MEGATRON_EP_INSTALL"):
    install()

__all__ = ["install", "uninstall", "is_installed", "compat", "MegatronEPDeepepManager", "MegatronEPHybridEPManager"]
