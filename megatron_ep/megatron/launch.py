"""Run a Megatron training script with megatron_ep's flex managers installed.

    torchrun --nproc-per-node 8 -m megatron_ep.megatron.launch pretrain_gpt.py \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep ...

Installs, then runs the script as `__main__` with the remaining arguments (Megatron's code and
flags unchanged). The script's directory goes first on sys.path, as `python script.py` would
put it: a Megatron-LM checkout's own megatron.core is then the one patched and used, even where
a megatron-core wheel is installed.

Arguments: SCRIPT [SCRIPT ARGUMENTS ...]; every argument after SCRIPT is the script's.
Environment: MEGATRON_EP_BACKEND (auto | torch | cuda; see docs/megatron.md),
MEP_DEBUG_TRACEBACK=1 (the traceback of a failure to install, not just one line). The script's
own errors are reported by the script, as without this launcher."""

from __future__ import annotations

import os
import runpy
import sys

PROG = "python -m megatron_ep.megatron.launch"


def _prepare(script: str) -> None:
    from megatron_ep import cli

    cli.check(os.path.isfile(script), f"no such script: {script} (the first argument is the training script, "
                                      "e.g. $MEGATRON_LM_DIR/pretrain_gpt.py)")
    # As `python script.py` would, and before install(): the script's own tree (a Megatron-LM
    # checkout) then provides megatron.core even where a megatron-core wheel is installed.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from . import install

    install()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    from megatron_ep import cli

    if not argv:
        print(f"{PROG}: error: the training script is missing (usage: {PROG} SCRIPT [ARGS ...]; --help)",
              file=sys.stderr)
        return 2
    code = cli.run_main(lambda _: _prepare(argv[0]), [], prog=PROG, hint=f"{cli.DEBUG_ENV}=1 shows the traceback")
    if code:
        return code
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
