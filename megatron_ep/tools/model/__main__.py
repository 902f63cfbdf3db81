"""``python -m megatron_ep.tools.model``: the report (``--help`` for the flags)."""

import sys

from ..cli import run_main
from .command import PROG, main

if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
