"""Host cost of every call of every path (a script, not a test): per-call host issue time and
loop time at 128 and 4096 tokens per rank (the low-latency calls up to 256), natively
(megatron_ep.Buffer), through megatron_ep.deep_ep, and for DeepEP V1 itself when `deep_ep` from a
DeepEP build imports, each in its own set of processes; --profile N adds where one call's host
time goes (cProfile).

    python3 scripts/bench_host.py --ranks 2                  # one GPU under MPS, or two GPUs
    python3 scripts/bench_host.py --ranks 2 --profile 25     # with each op's top 25 functions
    python3 scripts/bench_host.py --cpu                      # CPU: checks the script
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# this checkout's megatron_ep (or, in the ranks of --base's implementation, that checkout's: set by
# bench/host.py for the processes it spawns), the bench package beside this file
sys.path[:0] = [os.environ.get("MEP_BENCH_CHECKOUT") or os.path.dirname(HERE), HERE]

from megatron_ep.tools import cli  # noqa: E402

if __name__ == "__main__":
    cli.require("torch", prog="scripts/bench_host.py")

from bench import host  # noqa: E402


def main():
    sys.exit(host.main(host.parse(description=__doc__.split("\n")[0])))


if __name__ == "__main__":
    main()
