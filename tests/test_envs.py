"""megatron_ep.envs: every environment variable megatron_ep reads is parsed in one place; a bad
value is an error naming the variable, never a silent default."""

import pytest

from megatron_ep import envs
from megatron_ep.permute import padded_host_counts, round_up


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
    """megatron_ep.cuda.extension loads torch before an extension (they link libc10): `import
    megatron_ep` does not load torch, and loading _C_nvshmem first in a fresh process without torch
    fails with 'libc10.so: cannot open shared object file'. A subprocess, so no earlier import of
    torch hides it."""
    import os
    import subprocess
    import sys

    code = ("import sys, megatron_ep.cuda.extension as ext; assert 'torch' in sys.modules; "
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
