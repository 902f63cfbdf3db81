"""Entry points as a new user meets them (issue 14): a bad argument gives a short answer that names
the problem and a non-zero exit status; a rank that fails comes back as one line; every command
line in the README parses with the options of the script it names, and every script or module
the README names answers --help; every option of every parser has a description and shows its
default. Each entry point runs as a subprocess, the way a user runs it."""

import os
import re
import shlex
import subprocess
import sys
import textwrap
import time

import pytest

import megatron.core  # noqa: F401  (CI installs megatron-core: a missing one must fail, not skip)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PY = sys.executable


def _env(extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRON_EP_DEBUG_TRACEBACK",
                                                            "MEGATRON_EP_RANK_ERRORS", "NODE_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra or {})
    return env


def _start(argv, env=None):
    return subprocess.Popen(argv, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=180):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, [ln for ln in out.splitlines() if ln.strip()]


# (what, argv, words the answer must contain)
BAD_ARGUMENTS = [
    ("demo: experts vs ranks", [PY, "-m", "megatron_ep.tools.demo", "--ranks", "3"],
     ["--experts 16", "multiple of the number of ranks (3)"]),
    ("demo: top-k", [PY, "-m", "megatron_ep.tools.demo", "--topk", "20"], ["--topk 20", "16 experts"]),
    ("demo: unknown option", [PY, "-m", "megatron_ep.tools.demo", "--bogus"], ["unrecognized arguments: --bogus"]),
    ("recipe: experts vs world", [PY, "recipes/train_moe.py", "--experts", "7"],
     ["--experts 7", "multiple of the world size 2"]),
    ("recipe: top-k vs experts", [PY, "recipes/train_moe.py", "--topk", "8", "--experts", "4"], ["--topk 8"]),
    ("A/B: experts vs world", [PY, "scripts/ab_throughput.py", "--experts", "6", "--nproc-per-node", "4"],
     ["--experts 6", "multiple of the world size 4"]),
    ("A/B: backends", [PY, "scripts/ab_throughput.py", "--backends", "nccl"], ["--backends: unknown ['nccl']"]),
    ("proxies: nproc", [PY, "-m", "recipes.proxies", "--preset", "cpu-toy", "--nproc", "3"],
     ["--experts 16", "world size 3"]),
    # the dry run prints only what the run would start: the same checks
    ("proxies: nproc, dry run", [PY, "-m", "recipes.proxies", "--preset", "cpu-toy", "--nproc", "3", "--dry-run"],
     ["--experts 16", "world size 3"]),
    ("proxies: one GPU", [PY, "-m", "recipes.proxies", "--preset", "gpu-1", "--dry-run"], ["needs 1 GPU, 0 visible"]),
    # --fp8 on the decode recipe's own default hidden size: refused before any process starts
    ("decode: FP8 hidden", [PY, "recipes/decode_moe.py", "--fp8"],
     ["--fp8 needs --hidden a multiple of 128", "--hidden 64"]),
    ("decode: sequence past the memory", [PY, "recipes/decode_moe.py", "--seq-len", "100000000"],
     ["needs about", "attention activations", "--force"]),
    ("overlap bench: tokens past the memory", [PY, "scripts/bench", "overlap", "--cpu", "--tokens", "100000000"],
     ["needs about", "activations", "--force"]),
    ("DeepSeek-V3 launcher: EP", ["bash", "recipes/deepseek_v3_ep64/launch.sh", "--dry-run", "--ep", "3"],
     ["--ep 3", "256 experts"]),
    ("Megatron launcher: script", [PY, "-m", "megatron_ep.megatron.launch", "no_such_pretrain_gpt.py"],
     ["no such script: no_such_pretrain_gpt.py"]),
    ("Megatron launcher: chunks without our experts", [PY, "-m", "megatron_ep.megatron.launch", "--ep-chunks", "2",
                                                       "README.md"], ["--ep-chunks needs --ep-experts grouped"]),
    ("Megatron launcher: budget 0", [PY, "-m", "megatron_ep.megatron.launch", "--ep-budget", "0", "README.md"],
     ["argument --ep-budget: must be a finite number > 0, got '0'"]),
    ("Megatron launcher: experts", [PY, "-m", "megatron_ep.megatron.launch", "--ep-experts", "te", "README.md"],
     ["argument --ep-experts: invalid choice: 'te'"]),
    ("model: FP8 hidden", [PY, "-m", "megatron_ep.tools.model", "--hidden", "100"], ["--hidden 100", "multiple of 128"]),
    # what no machine runs is refused before a process starts (the estimate's own tests:
    # test_resources.py, against given machines)
    ("demo: processes past the cores", [PY, "-m", "megatron_ep.tools.demo", "--ranks", "4096", "--experts", "4096"],
     ["4096 processes on this machine are more than", "per core", "--force"]),
    ("demo: weights past the memory", [PY, "-m", "megatron_ep.tools.demo", "--experts", "10000000"],
     ["needs about", "expert weights", "available", "--force"]),
    ("recipe: processes past the cores", [PY, "recipes/train_moe.py", "--nproc-per-node", "4096", "--experts", "4096"],
     ["4096 processes on this machine are more than", "--force"]),
    ("recipe: sequence past the memory", [PY, "recipes/train_moe.py", "--seq-len", "100000000"],
     ["needs about", "attention activations", "--force"]),
    ("A/B: budget factor nan", [PY, "scripts/ab_throughput.py", "--budget-factor", "nan"],
     ["argument --budget-factor: must be a finite number > 0, got 'nan'"]),
    ("A/B: budget factor -1", [PY, "scripts/ab_throughput.py", "--budget-factor", "-1"],
     ["argument --budget-factor: must be a finite number > 0, got '-1'"]),
    ("A/B: budget under one row", [PY, "scripts/ab_throughput.py", "--backends", "hybridep-budget", "--budget-factor",
                                   "0.001"], ["--budget-factor 0.001 gives a budget of 0.128 rows", "less than one row"]),
]


def test_bad_arguments_give_one_short_line():
    """All at once (each pays the torch import): non-zero status, under 5 non-blank lines, the
    problem named, no traceback and no third-party warning."""
    env = {"PYTHON": PY}
    procs = [(what, _start(argv, env), words) for what, argv, words in BAD_ARGUMENTS]
    for what, proc, words in procs:
        code, lines = _finish(proc)
        text = "\n".join(lines)
        assert code != 0, (what, text)
        assert len(lines) < 5, (what, text)
        for w in words:
            assert w in text, (what, w, text)
        assert "Traceback" not in text and "Warning" not in text, (what, text)


FAIL_ON_ONE_RANK = textwrap.dedent("""
    import os, sys, time
    from megatron_ep.tools import cli

    def main(argv):
        if cli.world_size_from_env() is None:
            return cli.launch(3, [sys.executable, __file__, *argv], prog="fails", grace_s=1.0)
        if os.environ["RANK"] == "1":
            raise RuntimeError("boom on rank 1\\nsecond line of the message")
        time.sleep(60)  # the others wait, as in a collective with the dead rank

    sys.exit(cli.run_main(main, prog="fails"))
""")


def test_failing_rank_is_one_line_and_debug_shows_the_traceback(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAIL_ON_ONE_RANK)
    t0 = time.monotonic()
    plain, debug = _start([PY, str(script)]), _start([PY, str(script), "--debug"])
    code, lines = _finish(plain, timeout=60)
    assert code == 1 and lines == ["fails: error: RuntimeError: boom on rank 1 "
                                   "(--debug or MEGATRON_EP_DEBUG_TRACEBACK=1 shows the traceback)"], lines
    code, lines = _finish(debug, timeout=60)
    text = "\n".join(lines)
    assert code == 1 and "Traceback" in text and "second line of the message" in text, text
    assert lines[-1] == "fails: error: RuntimeError: boom on rank 1", text
    assert time.monotonic() - t0 < 40  # the waiting ranks were stopped, not waited for


def test_under_torchrun_rank_0_says_a_bad_argument():
    """Under torchrun each rank checks: rank 0 prints the line, the others exit silently."""
    procs = [_start([PY, "-m", "megatron_ep.tools.demo", "--experts", "10"],
                    {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "4"}) for r in (0, 1)]
    (c0, out0), (c1, out1) = (_finish(p) for p in procs)
    assert c0 == 2 and out0 == ["python -m megatron_ep.tools.demo: error: --experts 10 must be a multiple of the number of "
                                "ranks (4): each rank owns the same number of experts"], out0
    assert c1 == 2 and out1 == [], out1


def test_under_torchrun_a_rank_refuses_what_this_machine_cannot_run():
    """The estimate counts the launcher's ranks on this machine (LOCAL_WORLD_SIZE) and refuses
    before the rank joins a process group."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4096", "LOCAL_WORLD_SIZE": "4096"}
    code, lines = _finish(_start([PY, "-m", "megatron_ep.tools.demo", "--experts", "4096"], env))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("python -m megatron_ep.tools.demo: error: 4096 processes on this machine are more than"), lines


def test_recipe_runs_quietly_through_its_own_launcher():
    """python recipes/train_moe.py starts its ranks itself; the output is the run, no warnings."""
    code, lines = _finish(_start([PY, "recipes/train_moe.py", "--nproc-per-node", "2", "--steps", "1"]), timeout=300)
    text = "\n".join(lines)
    assert code == 0, text
    assert lines[0].startswith("megatron_ep installed into megatron-core"), text
    assert "world=2 dispatcher=hybridep" in lines[1] and lines[2].startswith("step "), text
    assert re.match(r"^\s+0\s+[\d.]+\s", lines[3]) and len(lines) == 4, text


# ---------------------------------------------------------------------------------- README
def _readme_commands():
    """Every command line of the README's ```bash blocks (continuations joined, comments cut)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                cmds.append(words)
    return cmds


def _parser_of(target):
    """(parser builder, how its argv is split) for a script path or module name."""
    from megatron_ep.tools import demo, model
    from recipes import proxies, train_moe
    from recipes.deepseek_v3_ep64 import launch as ds_launch

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import ab_throughput

    return {
        "megatron_ep.tools.demo": demo.parse_args,
        "scripts/run_demo.sh": demo.parse_args,  # set-up, then the demo with these arguments
        "megatron_ep.tools.model": lambda argv: model.build_parser().parse_args(argv),
        "recipes/train_moe.py": train_moe.parse_args,
        "scripts/ab_throughput.py": ab_throughput.parse_args,
        "recipes.proxies": lambda argv: proxies.build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv),
        "recipes/deepseek_v3_ep64/launch.sh": ds_launch.parse_args,
    }.get(target)


def _split(words):
    """(target script or module, its arguments, launcher arguments) of one README command."""
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
        words = words[1:]
    head, launcher = words[0], []
    if head == "torchrun":
        i = next(i for i, w in enumerate(words) if w == "-m" or w.endswith(".py"))
        launcher, words = words[1:i], words[i:]
        return (words[1], words[2:], launcher) if words[0] == "-m" else (words[0], words[1:], launcher)
    if head in ("python", "python3"):
        return (words[2], words[3:], None) if words[1] == "-m" else (words[1], words[2:], None)
    if head == "bash":
        return words[1], words[2:], None
    return head, words[1:], None


def test_readme_command_lines_parse():
    """Each README command's arguments go through its script's own parser (and torchrun's):
    no unknown option, no bad value. Set-up commands are checked to exist."""
    from torch.distributed.run import get_args_parser

    checked = []
    for words in _readme_commands():
        target, args, launcher = _split(words)
        if launcher is not None:
            get_args_parser().parse_args(launcher + ["x.py"])
        if target in ("source", "pip", "-c", "scripts/test.sh") or target.startswith(("-", "/")):
            continue  # set-up of the user's shell or environment; test.sh passes pytest's arguments
        parse = _parser_of(target)
        if parse is None:
            path = target if os.path.exists(os.path.join(ROOT, target)) else target.replace(".", "/") + ".py"
            assert os.path.exists(os.path.join(ROOT, path)) or target == "megatron_ep.megatron.launch" or \
                target == "pretrain_gpt.py", words
            continue
        if target == "recipes/deepseek_v3_ep64/launch.sh" and "--dry-run" not in args:
            continue
        parse(list(args))
        checked.append(target)
    assert {"scripts/run_demo.sh", "recipes/train_moe.py", "scripts/ab_throughput.py", "recipes.proxies",
            "recipes/deepseek_v3_ep64/launch.sh"} <= set(checked), checked


def _readme_targets():
    """Scripts and modules the README names in a command (blocks and inline `python -m ...`)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    targets = {_split(words)[0] for words in _readme_commands()}
    targets |= set(re.findall(r"python\s+-m\s+([\w.]+)", text))
    targets |= set(re.findall(r"`(?:python|bash|torchrun[^`]*?)\s+((?:scripts|recipes)/[\w/]+\.(?:py|sh))", text))
    return sorted(t for t in targets if t.startswith(("megatron_ep", "recipes", "scripts/"))
                  and not t.startswith("scripts/run_demo") and not t.startswith("scripts/test"))


def test_readme_scripts_answer_help():
    targets = _readme_targets()
    assert {"megatron_ep.tools.demo", "megatron_ep.tools.model", "megatron_ep.megatron.launch", "recipes.proxies",
            "recipes/train_moe.py", "scripts/ab_throughput.py", "recipes/deepseek_v3_ep64/launch.sh"} <= set(targets), targets
    procs = []
    for t in targets:
        argv = (["bash", t] if t.endswith(".sh") else [PY, t] if t.endswith(".py") else [PY, "-m", t]) + ["--help"]
        procs.append((t, _start(argv, {"PYTHON": PY})))
    for t, proc in procs:
        code, lines = _finish(proc)
        assert code == 0 and len(lines) > 3, (t, "\n".join(lines))
        assert "Warning" not in "\n".join(lines), (t, "\n".join(lines))


def _parsers():
    from megatron_ep.tools import demo, model
    from recipes import decode_moe, proxies, train_moe
    from recipes.deepseek_v3_ep64 import launch as ds_launch

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import ab_throughput
    from bench import overlap as bench_overlap

    return {"demo": demo.build_parser(), "model": model.build_parser(), "train_moe": train_moe.build_parser(),
            "ab_throughput": ab_throughput.build_parser(), "proxies": proxies.build_parser(),
            "deepseek_v3_ep64": ds_launch.build_parser(), "decode_moe": decode_moe.build_parser(),
            "bench overlap": bench_overlap.build_parser()}


# parsers whose every value-taking option states its default in --help, even one filled in later
# (the overlap bench's sizes depend on --cpu)
EVERY_DEFAULT_SHOWN = ("bench overlap",)


@pytest.mark.parametrize("name", ["demo", "model", "train_moe", "ab_throughput", "proxies", "deepseek_v3_ep64",
                                  "decode_moe", "bench overlap"])
def test_every_option_has_a_description_and_its_default(name):
    """Each option is described, shows its default (0 included: it equals False), and says it
    once (a help text that states its default gets no second one)."""
    import argparse

    parser = _parsers()[name]
    text = parser.format_help()
    assert parser.description and parser.description.strip()[:20] in text
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        assert action.help and action.help.strip(), f"{name}: {flag} has no description"
        shown = parser._get_formatter()._expand_help(action)  # the text --help prints for it
        assert len(re.findall(r"\(default\b", shown)) <= 1, f"{name}: {flag} says its default twice: {shown}"
        has_default = not (action.default is None or action.default is False or action.default is argparse.SUPPRESS)
        if action.nargs != 0 and (has_default or name in EVERY_DEFAULT_SHOWN):
            assert "default" in shown, f"{name}: {flag} does not show its default {action.default!r}: {shown}"


def test_decode_help_lists_no_training_option():
    """recipes/decode_moe.py runs one decode step: its --help has the model's options, not the
    training loop's (steps, optimiser, timers, chunked experts, shared-expert overlap)."""
    from recipes import decode_moe, train_moe

    parser = decode_moe.build_parser()
    flags = {f for a in parser._actions for f in a.option_strings}
    assert {"--hidden", "--experts", "--dispatcher", "--fp8", "--tol", "--force"} <= flags, flags
    assert not flags & {"--steps", "--lr", "--no-time-comm", "--chunked-experts", "--shared-expert-overlap"}, flags
    args = parser.parse_args([])  # what the shared model code reads still has its value
    assert all(hasattr(args, name) for name in train_moe.TRAINING_ONLY), args


@pytest.mark.parametrize("name", ["demo", "train_moe", "ab_throughput"])
def test_every_numeric_option_is_range_checked(name, capsys):
    """Each int or float option of the entry points that start ranks has a range (cli.integer /
    cli.number) holding its default; a value below it, and nan / inf for a float, end the parse
    (exit status 2) with one line naming the option, before anything runs."""
    parser = _parsers()[name]
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.type is None:
            continue
        flag = action.option_strings[-1]
        assert action.type not in (int, float), f"{name}: {flag} has no range (type={action.type.__name__})"
        bounds = getattr(action.type, "bounds", None)
        if bounds is None:
            continue
        low, high = bounds
        if action.default is not None:
            assert low <= action.default and (high is None or action.default <= high), (name, flag, action.default)
        is_float = isinstance(low, float)
        bad = [str(low - 1)] + (["nan", "inf"] if is_float else [str(high + 1)] if high is not None else [])
        for value in bad:
            with pytest.raises(SystemExit) as e:
                parser.parse_args([flag, value])
            err = capsys.readouterr().err.strip()
            assert e.value.code == 2 and len(err.splitlines()) == 1 and f"argument {flag}: must be" in err, (flag, value, err)
        checked += 1
    assert checked >= {"demo": 8, "train_moe": 14, "ab_throughput": 17}[name], checked


def test_megatron_launcher_help_lists_its_options():
    """The launcher's --help names every option it takes before the script."""
    code, lines = _finish(_start([PY, "-m", "megatron_ep.megatron.launch", "--help"]))
    text = "\n".join(lines)
    assert code == 0
    for option in ("--ep-experts", "--ep-gemm", "--ep-chunks", "--ep-budget", "--ep-backend"):
        assert option in text, f"the launcher's --help does not list {option}"


# ------------------------------------------------------------------- outside the environment
# (prog, argv after the interpreter)
ENTRY_POINTS = [
    ("python -m megatron_ep.tools.demo", ["-m", "megatron_ep.tools.demo"]),
    ("python -m megatron_ep.megatron.launch", ["-m", "megatron_ep.megatron.launch", "pretrain_gpt.py"]),
    ("recipes/train_moe.py", ["recipes/train_moe.py"]),
    ("recipes/decode_moe.py", ["recipes/decode_moe.py"]),
    ("python -m recipes.proxies", ["-m", "recipes.proxies", "--preset", "cpu-toy"]),
    # the dry run checks the command as the run does, which needs torch and megatron-core
    ("python -m recipes.proxies", ["-m", "recipes.proxies", "--preset", "cpu-toy", "--dry-run"]),
    ("scripts/ab_throughput.py", ["scripts/ab_throughput.py"]),
    ("scripts/bench overlap", ["scripts/bench", "overlap", "--cpu"]),
]


def test_without_torch_each_entry_point_says_so_in_one_line():
    """`python -S` does not load the site module, so this interpreter sees no site-packages: no
    torch, as a system python outside .venv. Each entry point answers one line naming torch and
    how to enter the environment, not an import traceback."""
    procs = [(prog, _start([PY, "-S", *argv])) for prog, argv in ENTRY_POINTS]
    for prog, proc in procs:
        code, lines = _finish(proc)
        assert code == 2 and len(lines) == 1, (prog, lines)
        assert lines[0].startswith(f"{prog}: error: torch") and "not importable by" in lines[0], lines
        assert "source .venv/bin/activate" in lines[0] and "scripts/env/setup_env.sh" in lines[0], lines
    # --list only prints the presets: no torch needed
    code, lines = _finish(_start([PY, "-S", "-m", "recipes.proxies", "--list"]))
    assert code == 0 and "recipes/train_moe.py" in lines[1], lines


def test_model_runs_without_torch():
    """The analytic model (`python -m megatron_ep.tools.model`) is arithmetic on the protocol's constants:
    it runs under `python -S` (no site-packages, no torch), as under a system python."""
    code, lines = _finish(_start([PY, "-S", "-m", "megatron_ep.tools.model"]))
    assert code == 0 and any(line.startswith("EP ") for line in lines), lines[-5:]


def test_the_missing_module_check_loads_no_torch():
    """cli (where require lives) and `import megatron_ep` load torch only on first use of the API."""
    code = ("import sys, megatron_ep, megatron_ep.tools.cli as cli; assert 'torch' not in sys.modules, 'torch loaded'; "
            "assert cli.missing_modules(['torch', 'no_such_module_xyz', 'no_such_pkg_xyz.core']) == "
            "['no_such_module_xyz', 'no_such_pkg_xyz.core']; "
            "assert megatron_ep.Buffer.__name__ == 'Buffer' and 'torch' in sys.modules")
    out = subprocess.run([PY, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------------- no GPU, torchrun
def test_demo_backend_cuda_without_a_gpu_says_so_before_torchrun():
    """Without a GPU the demo names the missing GPU at once, and does not send the user to
    torchrun (whose failure report would follow)."""
    code, lines = _finish(_start([PY, "-m", "megatron_ep.tools.demo", "--backend", "cuda"]))
    assert code == 2 and lines == ["python -m megatron_ep.tools.demo: error: --backend cuda needs a CUDA GPU (none is "
                                   "visible); use --backend torch"], lines


def test_under_torchrun_the_failure_report_names_the_cause():
    """torchrun prints its own report after a failed rank; the rank's one line comes first and is
    the report's root cause (not a pointer to how to get a traceback)."""
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    want = "python -m megatron_ep.megatron.launch: error: no such script: nosuch.py"
    code, lines = _finish(_start([*torchrun, "-m", "megatron_ep.megatron.launch", "nosuch.py"]))
    ours = [i for i, ln in enumerate(lines) if ln.startswith(want)]
    assert code != 0 and ours, lines
    report = lines[ours[0] + 1:]
    assert any(ln.strip().startswith("traceback : " + want) for ln in report), lines
    assert not any("To enable traceback" in ln for ln in report), lines


# ------------------------------------------------------------------------ MEGATRON_EP_BACKEND
def test_a_bad_backend_variable_is_refused_in_one_line():
    env = {"MEGATRON_EP_BACKEND": "cdua"}
    procs = [(argv, _start([PY, *argv], env)) for argv in (
        ["recipes/train_moe.py"], ["recipes/train_moe.py", "--backend", "torch"], ["scripts/ab_throughput.py"],
        ["recipes/decode_moe.py"], ["-m", "megatron_ep.megatron.launch", "README.md"])]
    for argv, proc in procs:
        code, lines = _finish(proc)
        assert code == 2 and len(lines) == 1, (argv, lines)
        assert "error: MEGATRON_EP_BACKEND='cdua' names no backend: use one of torch, cuda, auto" in lines[0], lines


def test_backend_option_wins_over_the_variable(monkeypatch):
    from megatron_ep.megatron import backend

    monkeypatch.setenv("MEGATRON_EP_BACKEND", " Torch ")
    assert backend.resolve(None, "--backend") == ("torch", None)  # without the option the variable applies
    assert backend.resolve("torch", "--backend") == ("torch", None)
    assert backend.resolve("cuda", "--backend") == (
        "cuda", "--backend cuda overrides MEGATRON_EP_BACKEND=torch (the command's option wins)")
    monkeypatch.setenv("MEGATRON_EP_BACKEND", "")
    assert backend.resolve(None, "--backend") == ("auto", None)
    monkeypatch.delenv("MEGATRON_EP_BACKEND")
    assert backend.resolve(None, "--backend") == ("auto", None)


def test_recipe_says_once_that_its_backend_option_wins():
    """A run: the ranks use --backend, and rank 0 alone says that it overrides the variable."""
    code, lines = _finish(_start([PY, "recipes/train_moe.py", "--nproc-per-node", "2", "--steps", "1", "--backend",
                                  "torch"], {"MEGATRON_EP_BACKEND": "auto"}), timeout=300)
    text = "\n".join(lines)
    assert code == 0, text
    assert lines.count("--backend torch overrides MEGATRON_EP_BACKEND=auto (the command's option wins)") == 1, text
    assert "buffer_backend=torch" in text, text


def test_launcher_backend_variable_and_option(tmp_path):
    """The launcher passes the variable on when --ep-backend is absent, and says so when the
    option overrides it."""
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('SCRIPT SEES', os.environ['MEGATRON_EP_BACKEND'])\n")
    runs = [_start([PY, "-m", "megatron_ep.megatron.launch", *opt, str(script)], {"MEGATRON_EP_BACKEND": "torch"})
            for opt in ([], ["--ep-backend", "auto"])]
    (c0, plain), (c1, overridden) = (_finish(p) for p in runs)

    def said(lines):  # the launcher's line (megatron-core's import warnings may come first)
        return next(ln for ln in lines if ln.startswith("megatron_ep.megatron.launch: managers installed"))

    assert c0 == 0 and "SCRIPT SEES torch" in plain and said(plain).endswith("MEGATRON_EP_BACKEND=torch"), plain
    assert c1 == 0 and "SCRIPT SEES auto" in overridden, overridden
    assert said(overridden).endswith("MEGATRON_EP_BACKEND=auto; --ep-backend auto overrides MEGATRON_EP_BACKEND=torch "
                                     "(the command's option wins)"), overridden


def test_launcher_prints_no_third_party_warning(tmp_path):
    """python -m megatron_ep.megatron.launch hides megatron-core's notes that Apex / Transformer
    Engine are not installed (and torch's "No CUDA runtime is found"), as our other commands do:
    its output is its own line, then the script's."""
    script = tmp_path / "train.py"
    script.write_text("print('SCRIPT RAN')\n")
    code, lines = _finish(_start([PY, "-m", "megatron_ep.megatron.launch", str(script)]))
    assert code == 0 and len(lines) == 2, lines
    assert lines[0].startswith("megatron_ep.megatron.launch: managers installed") and lines[1] == "SCRIPT RAN", lines


# ----------------------------------------------------------------------------------- switches
BAD_SWITCHES = [  # (variable, argv): each command reads the switch, or imports what reads it
    ("MEGATRON_EP_DEBUG_TRACEBACK", [PY, "-m", "megatron_ep.tools.demo", "--ranks", "3"]),
    ("MEGATRON_EP_DEBUG_TRACEBACK", [PY, "-m", "megatron_ep.tools.model"]),
    ("MEGATRON_EP_DEBUG_TRACEBACK", ["bash", "recipes/deepseek_v3_ep64/launch.sh", "--dry-run"]),
    ("MEGATRON_EP_INSTALL", [PY, "recipes/train_moe.py"]),
    ("MEGATRON_EP_INSTALL", [PY, "-m", "megatron_ep.megatron.launch", "README.md"]),
    ("MEGATRON_EP_INSTALL", [PY, "scripts/ab_throughput.py"]),
    ("MEGATRON_EP_CHECK_INPUTS", [PY, "scripts/bench", "overlap", "--cpu"]),
]


def test_a_bad_switch_is_one_line():
    """A switch set to neither on nor off (1/true/yes/on, 0/false/no/off) is refused in one line
    naming it, exit status 2, before the command does anything: not a traceback out of the
    parser, whichever command reads it or imports the module that does."""
    procs = [(name, argv, _start(argv, {name: "maybe", "PYTHON": PY})) for name, argv in BAD_SWITCHES]
    for name, argv, proc in procs:
        code, lines = _finish(proc)
        assert code == 2 and len(lines) == 1, (argv, lines)
        assert f"error: {name}='maybe' is not a switch: use 1 or 0" in lines[0], (argv, lines)


def test_output_to_a_closed_pipe_ends_quietly():
    """`cmd | head -1`: the reader goes away before the command has written everything. The
    command ends as one killed by SIGPIPE (status 141), without an error line or a traceback.
    `true` reads nothing, so every write meets the closed pipe."""
    for cmd in ("bash recipes/deepseek_v3_ep64/launch.sh --dry-run", f"{shlex.quote(PY)} -m recipes.proxies --list"):
        out = subprocess.run(["bash", "-c", f"{cmd} | true; echo \"status ${{PIPESTATUS[0]}}\""], cwd=ROOT,
                             env=_env({"PYTHON": PY}), capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "status 141" and out.stderr == "", (cmd, out.stdout, out.stderr)


def test_overlap_bench_on_cpu_is_a_small_smoke_with_progress():
    """scripts/bench overlap --cpu: small sizes by default (seconds, not the GPU sizes), a
    line as it starts and one per chunk count as it is timed, then the table."""
    t0 = time.monotonic()
    code, lines = _finish(_start([PY, "scripts/bench", "overlap", "--cpu"]), timeout=240)
    text = "\n".join(lines)
    assert code == 0, text
    assert lines[0].startswith("scripts/bench overlap: starting 2 ranks (CPU, torch backend)"), text
    progress = [ln for ln in lines if re.match(r"^  chunks \d+: timed on rank 0", ln)]
    assert len(progress) == 3 and lines[1:4] == progress, text  # chunk counts 1, 2, 4, before the table
    assert "64 tokens/rank, hidden 256" in text and "not speed claims" in text, text
    assert time.monotonic() - t0 < 120, text


def test_test_summary_counts_skips_once_per_reason(tmp_path):
    """The suite's summary (pyproject's -r, tests/conftest.py): without a GPU every GPU test
    skips, and the summary says so once per reason with the count, not one SKIPPED line per test;
    a failure is still listed on its own line."""
    (tmp_path / "test_some.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.skipif(True, reason="needs a CUDA GPU and the built extension")
        @pytest.mark.parametrize("n", range(5))
        def test_gpu(n):
            pass

        def test_other():
            pytest.skip("no DeepEP checkout here")

        def test_fails():
            assert False
    """))
    out = subprocess.run([PY, "-m", "pytest", "-c", os.path.join(ROOT, "pyproject.toml"), "--rootdir", str(tmp_path),
                          "-p", "conftest", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=_env({"PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])}),
                         capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert not [ln for ln in lines if ln.startswith("SKIPPED")], out.stdout
    assert [ln.strip() for ln in lines if "skipped:" in ln] == ["5 skipped: needs a CUDA GPU and the built extension",
                                                                 "1 skipped: no DeepEP checkout here"], out.stdout
    assert any(ln.startswith("FAILED") and "test_fails" in ln for ln in lines), out.stdout
