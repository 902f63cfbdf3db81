"""Run a Megatron training script with megatron_ep's flex managers installed.

    torchrun --nproc-per-node 8 -m megatron_ep.megatron.launch [OPTIONS] pretrain_gpt.py \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep ...

Installs, applies the options, then runs the script as `__main__` with the remaining arguments
(Megatron's code and flags unchanged). The script's directory goes first on sys.path, as `python
script.py` would put it: a Megatron-LM checkout's own megatron.core is then the one patched and
used, even where a megatron-core wheel is installed.

Options (before SCRIPT; every argument after SCRIPT is the script's):
  --ep-experts {megatron,grouped}  the MoE layers' experts: the spec's own (default), or
                                   megatron_ep's GroupedGemmExperts (grouped GEMMs straight on the
                                   expert-major layout; DeepGEMM, torch grouped_mm or a loop)
  --ep-gemm {auto,deepgemm,grouped_mm,loop}  GroupedGemmExperts' GEMMs (default auto)
  --ep-chunks N                    chunked experts on every MoE layer: dispatch, experts and combine
                                   in N pipelined token chunks, 1 <= N <= 16 (needs --ep-experts
                                   grouped and --moe-flex-dispatcher-backend hybridep)
  --ep-budget F                    the hybridep static budget (moe_expert_rank_capacity_factor F,
                                   where the script's config leaves it unset): no host sync;
                                   refused with another flex backend
  --ep-backend {auto,cuda,torch}   MEGATRON_EP_BACKEND (default: the environment's, else auto)

Environment: MEGATRON_EP_BACKEND (auto | torch | cuda; see docs/megatron.md; a bad value is refused,
and --ep-backend wins over it), the other MEGATRON_EP_* variables the managers read (a bad value
is refused before the script runs), MEGATRON_EP_DEBUG_TRACEBACK=1 (the traceback of a failure to
install, not just one line). The script's own errors are reported by the script, as without
this launcher; megatron-core's notes that Apex / Transformer Engine are not installed are hidden,
as in our other commands."""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
from typing import Optional

PROG = "python -m megatron_ep.megatron.launch"


def _parser() -> argparse.ArgumentParser:
    from megatron_ep.tools import cli

    from ..experts.overlap import MAX_CHUNKS
    from .backend import BACKENDS
    from .layer_options import EXPERTS

    p = cli.ArgumentParser(prog=PROG, add_help=False, debug=False)
    p.add_argument("--ep-experts", choices=EXPERTS, default="megatron")
    p.add_argument("--ep-gemm", choices=("auto", "deepgemm", "grouped_mm", "loop"), default="auto")
    p.add_argument("--ep-chunks", type=cli.integer(1, MAX_CHUNKS), default=0)
    p.add_argument("--ep-budget", type=cli.number(0.0, above=True), default=None)
    p.add_argument("--ep-backend", choices=BACKENDS, default=None)
    return p


def split_argv(argv):
    """(our options, [SCRIPT, its arguments]): ours are the --ep-* words before the first other one."""
    i = 0
    while i < len(argv) and argv[i].startswith("--ep-"):
        i += 1 if "=" in argv[i] else 2
    return argv[:i], argv[i:]


def _use_backend(option):
    """MEGATRON_EP_BACKEND set to --ep-backend, else to the variable's own value, else auto (a bad
    value of the variable is refused here, before the script runs); returns the line saying that
    --ep-backend overrides a different value of the variable, or None."""
    from .backend import ENV, resolve

    backend, overridden = resolve(option, "--ep-backend")
    os.environ[ENV] = backend
    return overridden


def script_option(args, name: str, default: Optional[str]) -> Optional[str]:
    """The value the script's arguments give option `name` (its last `--name V` or `--name=V`),
    else `default` (Megatron's)."""
    value = default
    for i, word in enumerate(args):
        if word == name and i + 1 < len(args):
            value = args[i + 1]
        elif word.startswith(name + "="):
            value = word.split("=", 1)[1]
    return value


def _check_hybridep_options(options, script_args) -> None:
    """--ep-budget and --ep-chunks act on the flex hybridep manager only: refused here, before the
    script runs, when the script's own arguments pick another dispatcher (with a YAML config they
    do not say: the managers and layers then refuse at model construction)."""
    from megatron_ep.tools import cli

    ours = [o for o, v in (("--ep-budget", options.ep_budget), ("--ep-chunks", options.ep_chunks)) if v]
    if not ours or "--yaml-cfg" in script_args:
        return
    dispatcher = script_option(script_args, "--moe-token-dispatcher-type", "allgather")
    backend = script_option(script_args, "--moe-flex-dispatcher-backend", "deepep")
    picked = f"--moe-token-dispatcher-type {dispatcher}" + (f" --moe-flex-dispatcher-backend {backend}"
                                                            if dispatcher == "flex" else "")
    cli.check(dispatcher == "flex" and backend == "hybridep",
              f"{' and '.join(ours)} act on megatron_ep's hybridep manager, but the script's arguments pick {picked} "
              f"(Megatron's defaults where not given): add --moe-token-dispatcher-type flex "
              f"--moe-flex-dispatcher-backend hybridep, or drop {' and '.join(ours)}")


def _prepare(script: str, options, script_args=()) -> None:
    from megatron_ep.tools import cli

    cli.check(os.path.isfile(script), f"no such script: {script} (the first argument after the options is the training "
                                      "script, e.g. $MEGATRON_LM_DIR/pretrain_gpt.py)")
    cli.check(not options.ep_chunks or options.ep_experts == "grouped",
              "--ep-chunks needs --ep-experts grouped (chunked experts run megatron_ep's experts)")
    _check_hybridep_options(options, list(script_args))
    overridden = _use_backend(options.ep_backend)
    if options.ep_budget is not None:
        os.environ["MEGATRON_EP_RANK_CAPACITY_FACTOR"] = repr(options.ep_budget)
    from . import check_environment

    try:  # what install() checks too, here as one usage line before the script runs
        check_environment()
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    # As `python script.py` would, and before install(): the script's own tree (a Megatron-LM
    # checkout) then provides megatron.core even where a megatron-core wheel is installed.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from . import install
    from .layer_options import describe, use_in_moe_layers

    install()
    log = logging.getLogger("megatron_ep")  # the Buffer's one line naming its backend, on rank 0
    if not log.handlers:
        log.addHandler(logging.StreamHandler(sys.stdout))
        log.setLevel(logging.INFO)
        log.propagate = False  # once, whatever handlers the script gives the root logger
    use_in_moe_layers(options.ep_experts, None if options.ep_gemm == "auto" else options.ep_gemm, options.ep_chunks)
    if os.environ.get("RANK", "0") == "0":
        budget = f", static budget {options.ep_budget}" if options.ep_budget is not None else ""
        print(f"megatron_ep.megatron.launch: managers installed; {describe()}{budget}; "
              f"MEGATRON_EP_BACKEND={os.environ['MEGATRON_EP_BACKEND']}" + (f"; {overridden}" if overridden else ""),
              flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    from megatron_ep.tools import cli

    cli.require("torch", prog=PROG)
    cli.quiet()  # megatron-core's notes about Apex / Transformer Engine, as our other commands
    ours, rest = split_argv(argv)
    if not rest:
        print(f"{PROG}: error: the training script is missing (usage: {PROG} [OPTIONS] SCRIPT [ARGS ...]; --help)",
              file=sys.stderr)
        return 2
    code = cli.run_main(lambda _: _prepare(rest[0], _parser().parse_args(ours), rest[1:]), [], prog=PROG, hint=f"{cli.DEBUG_ENV}=1 shows the traceback")
    if code:
        return code
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
