"""megatron_ep.core.envs: every environment variable megatron_ep reads is parsed in one place; a bad
value is an error naming the variable, never a silent default."""

import pytest

from megatron_ep.core import envs
from megatron_ep.core.permute import padded_host_counts, round_up


@pytest.mark.parametrize("value,want", [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                                        ("0", False), ("", False), ("No", False), ("off", False)])
def test_flag_values(monkeypatch, value, want):
    monkeypatch.setenv("MEP_TEST_FLAG", value)
    assert envs.flag("MEP_TEST_FLAG") is want


def test_flag_unset_and_bad(monkeypatch):
    monkeypatch.delenv("MEP_TEST_FLAG", raising=False)
    assert envs.flag("MEP_TEST_FLAG") is False
    monkeypatch.setenv("MEP_TEST_FLAG", "2")
    with pytest.raises(ValueError, match="MEP_TEST_FLAG='2' is not a switch"):
        envs.flag("MEP_TEST_FLAG")


def test_integer_and_number(monkeypatch):
    monkeypatch.delenv("MEP_TEST_N", raising=False)
    assert envs.integer("MEP_TEST_N", 7) == 7 and envs.number("MEP_TEST_N", None) is None
    monkeypatch.setenv("MEP_TEST_N", " 12 ")
    assert envs.integer("MEP_TEST_N", 7, minimum=1) == 12 and envs.number("MEP_TEST_N", 1.0, above=0) == 12.0
    for bad, err in (("x", "is not an integer"), ("0", "must be at least 1")):
        monkeypatch.setenv("MEP_TEST_N", bad)
        with pytest.raises(ValueError, match=f"MEP_TEST_N.*{err}"):
            envs.integer("MEP_TEST_N", 7, minimum=1)
    monkeypatch.setenv("MEP_TEST_N", "-1.5")
    with pytest.raises(ValueError, match="MEP_TEST_N=-1.5 must be greater than 0"):
        envs.number("MEP_TEST_N", 1.0, above=0)


def test_readers_refuse_bad_values(monkeypatch):
    """The library's own readers go through envs: a typo raises naming the variable."""
    from megatron_ep.megatron import chunked

    monkeypatch.setenv(chunked.ENV, "two")
    with pytest.raises(ValueError, match="MEGATRON_EP_CHUNKED_EXPERTS='two' is not an integer"):
        chunked.chunks_from_env()
    monkeypatch.setenv(chunked.ENV, "0")
    with pytest.raises(ValueError, match="at least 1"):
        chunked.chunks_from_env()


def test_import_installs_nothing(monkeypatch):
    """MEGATRON_EP_INSTALL is read by megatron_ep.megatron only: importing megatron_ep installs
    nothing (a subprocess, so no earlier import hides it)."""
    import subprocess
    import sys

    code = ("import sys, megatron_ep; print('megatron_ep.megatron' in sys.modules, "
            "'megatron.core.transformer.moe.token_dispatcher' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "MEGATRON_EP_INSTALL": "1"}, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_one_padding_rule():
    assert [round_up(n, 128) for n in (0, 1, 127, 128, 129)] == [0, 128, 128, 128, 256]
    assert padded_host_counts([0, 3, 16, 17], 16) == [0, 16, 16, 32]


def test_extension_loads_after_torch():
    """megatron_ep.backends.cuda.extension loads torch before an extension (they link libc10): `import
    megatron_ep` does not load torch, and loading _C_nvshmem first in a fresh process without torch
    fails with 'libc10.so: cannot open shared object file'. A subprocess, so no earlier import of
    torch hides it."""
    import os
    import subprocess
    import sys

    code = ("import sys, megatron_ep.backends.cuda.extension as ext; assert 'torch' in sys.modules; "
            "print(ext.NVSHMEM.error or 'loaded' if ext.NVSHMEM.available() else ext.NVSHMEM.error)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert "libc10" not in out.stdout, out.stdout


def test_default_is_not_range_checked(monkeypatch):
    """An unset variable gives its default, even one outside the range a set value must keep
    (MEGATRON_EP_CHUNKED_EXPERTS: 0 = off, a set value >= 1)."""
    from megatron_ep.megatron import chunked

    monkeypatch.delenv(chunked.ENV, raising=False)
    assert chunked.chunks_from_env() == 0 and envs.integer("MEP_TEST_UNSET", 0, minimum=1) == 0


# ------------------------------------------------------------- one parser for every switch
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENVS_PY = os.path.join(ROOT, "megatron_ep", "core", "envs.py")


def _sources():
    for top in ("megatron_ep", "recipes", "scripts"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".py", ".sh")):
                    yield os.path.join(dirpath, f)
    yield os.path.join(ROOT, "setup.py")


def test_every_switch_is_parsed_by_envs():
    """Every switch the library, setup.py and the set-up script read goes through envs.flag (the
    shell asks `envs.py flag`), and envs.SWITCHES lists it, so commands can refuse a bad one
    first. No switch is compared with "1" by hand (setup.py and setup_env.sh once did: `true`
    there meant off)."""
    read = set()
    for path in _sources():
        text = open(path).read()
        read |= set(re.findall(r"""\b(?:envs\.)?_?flag\(\s*["']([A-Z0-9_]+)["']""", text))
        for const in re.findall(r"\b(?:envs\.)?_?flag\(\s*([A-Z][A-Z0-9_]*)\)", text):  # flag(DEBUG_ENV)
            read |= set(re.findall(rf"""^{const} *= *["']([A-Z0-9_]+)["']""", text, re.M))
        for args in re.findall(r"envs\.py(?: --prog \S+)? flag ((?:[A-Z0-9_]+ ?)+)", text):
            read |= set(args.split())
        rel = os.path.relpath(path, ROOT)
        assert not re.search(r"""environ\.get\(["'](MEP|MEGATRON_EP)_[A-Z_]+["'](, ["'][01]["'])?\) *[!=]= *["']1["']""",
                             text), rel
        assert not re.search(r"""\$\{(MEP|MEGATRON_EP)_[A-Z_]+:-[01]\}" *!?= *"1\"""", text), rel
    assert {"MEGATRON_EP_DEBUG_TRACEBACK", "MEGATRON_EP_INSTALL", "MEGATRON_EP_CPU_ONLY", "MEGATRON_EP_SKIP_CUDA", "MEGATRON_EP_REQUIRE_EXTENSION",
            "MEGATRON_EP_DEBUG", "MEGATRON_EP_PTXAS_VERBOSE"} <= read, read
    assert read == set(envs.SWITCHES), read ^ set(envs.SWITCHES)


def test_one_prefix_for_what_the_package_reads():
    """Every variable the package, its build and its set-up name is MEGATRON_EP_*; an MEP_ name
    appears only as an old name (envs.RENAMED) or in a comment of the scripts' own knobs."""
    pkg = [p for p in _sources() if os.path.relpath(p, ROOT).startswith("megatron_ep" + os.sep)]
    found = set()
    for path in pkg + [os.path.join(ROOT, "setup.py")]:
        found |= set(re.findall(r"\bMEP_[A-Z0-9_]+", open(path).read()))
    assert found <= set(envs.RENAMED), found - set(envs.RENAMED)
    assert all(new.startswith("MEGATRON_EP_") and new[len("MEGATRON_EP_"):] == old[len("MEP_"):]
               for old, new in envs.RENAMED.items())


def test_old_names_still_read_with_one_notice(monkeypatch, capsys):
    monkeypatch.setattr(envs, "_noticed", set())
    monkeypatch.delenv("MEGATRON_EP_TIMEOUT_S", raising=False)
    monkeypatch.setenv("MEP_TIMEOUT_S", "7.5")
    assert envs.number("MEGATRON_EP_TIMEOUT_S", 60.0, above=0) == 7.5
    assert envs.number("MEGATRON_EP_TIMEOUT_S", 60.0, above=0) == 7.5
    assert capsys.readouterr().err.splitlines() == [
        "megatron_ep: MEP_TIMEOUT_S is now MEGATRON_EP_TIMEOUT_S; the old name still works"]
    monkeypatch.setenv("MEGATRON_EP_TIMEOUT_S", "9")  # the new name wins
    assert envs.number("MEGATRON_EP_TIMEOUT_S", 60.0, above=0) == 9.0
    monkeypatch.setenv("MEP_SKIP_CUDA", "yes")
    monkeypatch.delenv("MEGATRON_EP_SKIP_CUDA", raising=False)
    assert envs.flag("MEGATRON_EP_SKIP_CUDA") is True
    monkeypatch.setenv("MEP_SKIP_CUDA", "maybe")
    with pytest.raises(ValueError, match="MEGATRON_EP_SKIP_CUDA='maybe'"):
        envs.flag("MEGATRON_EP_SKIP_CUDA")
    assert envs.raw("MEGATRON_EP_INSTALL", {"MEP_INSTALL": "1"}) is None  # never read under MEP_


def test_flag_command_line():
    """`python3 megatron_ep/core/envs.py flag NAME...`, standard library only (-S: no site-packages):
    1 or 0 per name; a bad value is one line naming it, exit status 2, nothing on stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEP_T")}
    out = subprocess.run([sys.executable, "-S", ENVS_PY, "flag", "MEP_TA", "MEP_TB", "MEP_TC"], capture_output=True,
                         text=True, timeout=60, env={**env, "MEP_TA": "True", "MEP_TB": "off"})
    assert out.returncode == 0 and out.stdout.split() == ["1", "0", "0"], out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-S", ENVS_PY, "--prog", "set-up", "flag", "MEP_TA", "MEP_TB"],
                         capture_output=True, text=True, timeout=60, env={**env, "MEP_TA": "1", "MEP_TB": "maybe"})
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.strip() == "set-up: error: MEP_TB='maybe' is not a switch: use 1 or 0 (true/false, yes/no, on/off)"


def test_setup_py_reads_switches_as_the_library_does(tmp_path):
    """setup.py takes `yes` for on and refuses `maybe` in one line: MEGATRON_EP_REQUIRE_EXTENSION=yes
    makes a build without torch an error (a torch that cannot be imported stands in)."""
    (tmp_path / "torch.py").write_text("raise ImportError('no torch in this build environment')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_EP_SKIP_CUDA", "MEGATRON_EP_REQUIRE_EXTENSION")}
    env["PYTHONPATH"] = str(tmp_path)

    def setup(**extra):
        return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env={**env, **extra})

    out = setup(MEGATRON_EP_REQUIRE_EXTENSION="yes")
    assert out.returncode != 0, out.stdout
    assert "MEGATRON_EP_REQUIRE_EXTENSION is on but the CUDA extension cannot be built: torch is not importable" in out.stderr
    out = setup(MEGATRON_EP_SKIP_CUDA="maybe")
    assert out.returncode != 0 and out.stderr.strip() == ("megatron_ep: MEGATRON_EP_SKIP_CUDA='maybe' is not a switch: use 1 "
                                                          "or 0 (true/false, yes/no, on/off)"), out.stderr
    out = setup(MEGATRON_EP_SKIP_CUDA="true", MEGATRON_EP_REQUIRE_EXTENSION="yes")  # skipping wins: a pure-Python build
    assert out.returncode == 0 and out.stdout.strip().endswith("megatron_ep"), out.stdout + out.stderr


def _fake_setup(tmp_path, **extra):
    """scripts/env/setup_env.sh against an environment whose python only logs its calls (and, for the
    build, prints two ninja steps): no install, no compile. Returns (result, the calls)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls"
    fake = venv / "bin" / "python"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"MEGATRON_EP_SKIP_CUDA=${{MEGATRON_EP_SKIP_CUDA-unset}} $*\" >> {calls}\n"
                    "case \"$*\" in *build_ext*)\n"
                    "  echo '[1/2] c++ -MMD -c -c /src/csrc/protocol/module.cpp -o /b/module.o -O2'\n"
                    "  echo 'megatron_ep: no nvcc found; building without the CUDA extension'\n"
                    "  echo '[2/2] /usr/local/cuda/bin/nvcc /b/a.o -o /b/dlink.o -dlink' ;;\n"
                    "esac\n")
    fake.chmod(0o755)
    with open(os.path.join(ROOT, "requirements.txt"), "rb") as f:
        cksum = subprocess.run(["cksum"], stdin=f, capture_output=True, text=True).stdout
    (venv / ".mep-requirements").write_text(cksum)  # requirements up to date: no pip
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_EP_SKIP_CUDA", "MEGATRON_EP_REQUIRE_EXTENSION", "MEGATRON_EP_CPU_ONLY")}
    env.update(MEGATRON_EP_VENV=str(venv), PYTHON=sys.executable, **extra)
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "env", "setup_env.sh")], capture_output=True, text=True,
                         timeout=120, env=env)
    return out, calls.read_text().splitlines() if calls.exists() else []


def test_setup_script_reads_switches_as_the_library_does(tmp_path):
    out, calls = _fake_setup(tmp_path / "bad", MEGATRON_EP_CPU_ONLY="maybe")
    assert out.returncode == 2 and calls == [], calls  # refused before anything ran
    assert out.stderr.strip() == "set-up: error: MEGATRON_EP_CPU_ONLY='maybe' is not a switch: use 1 or 0 (true/false, yes/no, on/off)"
    out, calls = _fake_setup(tmp_path / "true", MEGATRON_EP_CPU_ONLY="true")
    assert out.returncode == 0, out.stderr
    build = [c for c in calls if "build_ext" in c]
    assert build and build[0].startswith("MEGATRON_EP_SKIP_CUDA=1 "), calls  # CPU only: the extension skipped


def test_setup_script_says_each_compile_step(tmp_path):
    """The compile is not silent: a line per compile step with the time so far, setup.py's own
    notes, and the total time; the full output goes to the build log."""
    out, _ = _fake_setup(tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert re.fullmatch(r"set-up: compiled \[1/2\] module\.cpp \(\dm\d\ds so far\)", lines[1]), lines
    assert lines[2] == "megatron_ep: no nvcc found; building without the CUDA extension", lines
    assert re.fullmatch(r"set-up: compiled \[2/2\] \(device link\) \(\dm\d\ds so far\)", lines[3]), lines
    assert re.fullmatch(r"set-up: compiled in \dm\d\ds", lines[4]), lines
    log = (tmp_path / "venv" / ".mep-build.log").read_text()
    assert "[1/2] c++ -MMD -c -c /src/csrc/protocol/module.cpp" in log, log
