"""python -m megatron_ep.deep_ep --path: the folder to put on PYTHONPATH so that `import deep_ep`
uses megatron_ep.deep_ep."""

import os
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--path"]:
        print("usage: python -m megatron_ep.deep_ep --path   (the folder that makes `import deep_ep` use megatron_ep's)",
              file=sys.stderr)
        return 2
    print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
