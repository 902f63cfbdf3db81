"""Every benchmark behind one entry (scripts/bench/__main__.py).

`python3 scripts/bench NAME [its arguments]` runs the benchmark NAME with its own arguments
(`python3 scripts/bench NAME --help` lists them). The figures they produce, with their
commands, are in docs/performance.md.

    python3 scripts/bench host --ranks 2 --phases      # host cost per call, beside DeepEP V1
    python3 scripts/bench normal --ranks 2             # the normal paths' kernels, NCCL, DeepEP
    python3 scripts/bench low-latency --ranks 2        # the low-latency path
"""

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.dirname(HERE)
ROOT = os.path.dirname(SCRIPTS)
# name -> (its file, relative to scripts/; what it measures)
BENCHES = {
    "normal": ("bench/normal.py", "the normal paths' dispatch and combine kernels against NCCL, DeepEP and the copy roofline"),
    "low-latency": ("bench/low_latency.py", "the low-latency dispatch and combine (decode), against DeepEP's"),
    "host": ("bench/host.py", "host cost per call of every op, natively, through megatron_ep.deep_ep and DeepEP V1"),
    "overlap": ("bench/overlap.py", "chunked experts against one round: the forward timeline and the model"),
    "link": ("bench/link.py", "the NVLink roofline between two GPUs (copy engine, SM stores, bulk copies)"),
    "gemm": ("bench/gemm.py", "the routed-expert GEMMs (DeepGEMM, torch._grouped_mm, the loop)"),
    "ab": ("ab_throughput.py", "Megatron A/B throughput runs across dispatcher backends"),
}


def usage() -> str:
    width = max(map(len, BENCHES))
    lines = [__doc__.split("\n")[0], "", "usage: python3 scripts/bench NAME [arguments]", ""]
    lines += [f"  {name:<{width}}  {what} (scripts/{script})" for name, (script, what) in BENCHES.items()]
    return "\n".join(lines)


def main(argv) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in BENCHES:
        print(f"unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # this checkout's megatron_ep and the `bench` package first; not this folder's modules as
    # top-level names (`host`, `link`). Spawned ranks inherit this path.
    sys.path[:] = [ROOT, SCRIPTS] + [p for p in sys.path if os.path.abspath(p or ".") not in (HERE, ROOT, SCRIPTS)]
    from megatron_ep.tools import cli  # standard library only

    # every benchmark needs torch: one line, not a traceback, where it is missing
    cli.require("torch", prog=f"scripts/bench {argv[0]}")
    path = os.path.join(SCRIPTS, BENCHES[argv[0]][0])
    # the benchmark runs as the main module, as a script would: spawned ranks run its file first
    sys.argv = [path] + list(argv[1:])
    runpy.run_path(path, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
