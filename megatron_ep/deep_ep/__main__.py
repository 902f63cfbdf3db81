"""python -m megatron_ep.deep_ep --path: the folder to put on PYTHONPATH so that `import deep_ep`
uses megatron_ep.deep_ep (megatron_ep.deep_ep.SHIM_DIR)."""

import argparse
import sys

from ..tools.cli import ArgumentParser, run_main
from . import SHIM_DIR

PROG = "python -m megatron_ep.deep_ep"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Print the folder that makes unmodified `import deep_ep` code use megatron_ep.deep_ep\n"
                    "(DeepEP V1's Python API on megatron_ep's kernels; docs/deep-ep.md):\n\n"
                    "  export PYTHONPATH=$(python -m megatron_ep.deep_ep --path)${PYTHONPATH:+:$PYTHONPATH}\n")
    p.add_argument("--path", action="store_true", required=True, help="print the folder to put first on PYTHONPATH")
    return p


def main(argv=None) -> int:
    build_parser().parse_args(argv)
    print(SHIM_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
