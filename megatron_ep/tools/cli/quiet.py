"""Third-party warnings that say nothing about a run of our scripts (megatron_ep.tools.cli)."""

from __future__ import annotations

import logging
import warnings

# (message regex matched at the start, category): printed by megatron-core / torch on machines
# without Apex or TransformerEngine, or for defaults our scripts do not choose; none of them
# says anything about the run (our recipes build Megatron's local, non-TE layer specs).
QUIET_WARNINGS = (
    (r"Apex is not installed", UserWarning),
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"Transformer Engine is not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),  # Megatron's own default cuda_graph_scope
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning),  # Megatron's call
)
QUIET_LOGS = {
    "torch.utils.cpp_extension": "No CUDA runtime is found",  # importing cpp_extension on a CPU machine
    "torch.multiprocessing.spawn": "Terminating process",
}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


_quiet_done = False


def quiet() -> None:
    """Install the filters above in this process (idempotent). For our scripts' entry points;
    the library itself never calls it."""
    global _quiet_done
    if _quiet_done:
        return
    _quiet_done = True
    for pattern, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name, prefix in QUIET_LOGS.items():
        logging.getLogger(name).addFilter(_DropMessage(prefix))
