"""Run a Megatron training script with megatron_ep's flex managers installed.

    torchrun --nproc-per-node 8 -m megatron_ep.megatron.launch pretrain_gpt.py \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep ...

Installs, then runs the script as `__main__` with the remaining arguments (Megatron's code and
flags unchanged)."""

from __future__ import annotations

import os
import runpy
import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    # As `python script.py` would, and before install(): the script's own tree (a Megatron-LM
    # checkout) then provides megatron.core even where a megatron-core wheel is installed.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from . import install

    install()
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
