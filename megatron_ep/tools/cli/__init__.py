"""What every command-line entry point shares (demo, recipes, A/B script, launchers, model).

* `ArgumentParser`: `--help` shows every option's default; a bad argument prints one line
  (`prog: error: ...`) instead of the whole usage; `--debug` is added.
* `integer(min, max)`, `number(min)`: option types that hold an option's range (finite floats
  only), so argparse refuses a bad value, naming the option, before anything runs.
* `run_main(main)`: runs an entry point. A failure prints one line naming the problem and
  returns a non-zero exit status (2 for a bad argument or a bad switch, 1 otherwise); `--debug` or
  `MEGATRON_EP_DEBUG_TRACEBACK=1` adds the traceback. In a multi-rank run one rank says it. Output to a
  reader that went away (`| head -1`) ends quietly, with SIGPIPE's status (141).
* `launch(nprocs, cmd)`: runs a command line as `nprocs` local ranks with torchrun's
  environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...); the caller validates its
  arguments first, and a failing rank comes back as one line, not a multi-process traceback.
* `require(*modules)`: a command run by an interpreter that cannot import torch (a system python
  outside the project's `.venv`) exits with one line saying so and how to enter the
  environment, instead of an import traceback; a switch (megatron_ep.core.envs.SWITCHES) that is
  neither on nor off is one line too. This module imports only the standard library,
  and `import megatron_ep` loads torch only on first use of its API, so commands call it first.
* `note(line)`: an informational line, printed by rank 0 only.
* `quiet()`: filters third-party warnings that say nothing about a run of our scripts
  (Apex / TransformerEngine absent, torch's "No CUDA runtime is found" on CPU machines, ...).
  Only our scripts call it; importing the library changes no filter.

Modules: failures (one line per failure, run_main), options (parser and option types),
environment (require), launching (launch), quiet.
"""

from .environment import ENV_HINT, missing_modules, require
from .failures import (DEBUG_ENV, DEBUG_HINT, UsageError, check, debug_requested, launched_by_us, note, one_line,
                       run_main, world_size_from_env)
from .launching import launch
from .options import ArgumentParser, HelpFormatter, integer, number
from .quiet import QUIET_LOGS, QUIET_WARNINGS, quiet

__all__ = ["ArgumentParser", "DEBUG_ENV", "DEBUG_HINT", "ENV_HINT", "HelpFormatter", "QUIET_LOGS", "QUIET_WARNINGS",
           "UsageError", "check", "debug_requested", "integer", "launch", "launched_by_us", "missing_modules", "note",
           "number", "one_line", "quiet", "require", "run_main", "world_size_from_env"]
