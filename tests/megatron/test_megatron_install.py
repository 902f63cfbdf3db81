"""install() / activation paths and the megatron-core version detection (single process)."""

import copy
import dataclasses
import os
import subprocess
import sys
import textwrap
import types

import pytest

import megatron.core  # noqa: E402,F401  (CI installs megatron-core: a missing one must fail, not skip)

import megatron_ep.megatron as mm  # noqa: E402
from megatron_ep.megatron import compat  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_install_is_idempotent_and_reversible():
    from megatron.core.transformer.moe import token_dispatcher as td

    mm.uninstall()
    original = td._DeepepManager, td._HybridEPManager
    assert not mm.is_installed()
    feats = mm.install()
    mm.install()
    assert mm.is_installed()
    assert td._DeepepManager is mm.MegatronEPDeepepManager and td._HybridEPManager is mm.MegatronEPHybridEPManager
    assert issubclass(td._DeepepManager, td._DispatchManager) and issubclass(td._HybridEPManager, td._DispatchManager)
    assert feats.version.startswith(("0.16", "0.17", "0.18", "0.19", "0.20"))
    mm.uninstall()
    assert (td._DeepepManager, td._HybridEPManager) == original
    mm.install()


def _probe_again(monkeypatch, align_fn):
    """compat.features() re-probed with get_align_size_for_quantization replaced."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(moe_utils, "get_align_size_for_quantization", align_fn)
    compat.features.cache_clear()


def test_probes_follow_fields_megatron_adds(monkeypatch):
    """A later megatron-core that reads a config field we never heard of (as main's
    moe_use_grouped_tensor): the probe answers it, install() works and reports the field."""
    def align(config):  # a future version: a new knob checked first
        return 512 if config.moe_some_future_knob else (256 if config.use_transformer_engine_op_fuser else 0)

    try:
        _probe_again(monkeypatch, align)
        feats = mm.install()
        assert feats.align_default == 0 and feats.align_fields[0] == "moe_some_future_knob"
        assert compat.features() is compat.features()  # one probe, cached
    finally:
        monkeypatch.undo()
        compat.features.cache_clear()


def test_a_failed_probe_leaves_megatron_untouched(monkeypatch):
    """A probe that raises: install() raises one IncompatibleMegatronError naming the version
    and the field, and Megatron keeps its own managers (nothing half-installed)."""
    from megatron.core.transformer.moe import token_dispatcher as td

    def align(config):
        return int(config.moe_some_future_knob) + 1  # int(None): TypeError

    mm.uninstall()
    original = td._DeepepManager, td._HybridEPManager
    try:
        _probe_again(monkeypatch, align)
        with pytest.raises(compat.IncompatibleMegatronError) as err:
            mm.install()
        message = str(err.value)
        assert megatron.core.__version__ in message and "'moe_some_future_knob'" in message, message
        assert (td._DeepepManager, td._HybridEPManager) == original and not mm.is_installed()
        with pytest.raises(compat.IncompatibleMegatronError):  # a failure is not cached: probed again
            compat.features()
    finally:
        monkeypatch.undo()
        compat.features.cache_clear()
        mm.install()
    assert mm.is_installed()


def _run(code, env=None, args=()):
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, *args] if args else [sys.executable, "-c", code], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


PROBE = "from megatron.core.transformer.moe import token_dispatcher as td; print('MANAGER', td._HybridEPManager.__module__)"


def test_activation_paths(tmp_path):
    """import megatron_ep.megatron.activate; MEGATRON_EP_INSTALL=1; python -m megatron_ep.megatron.launch."""
    out = _run(f"import megatron_ep.megatron; {PROBE}; import megatron_ep.megatron.activate; {PROBE}", env={"MEGATRON_EP_INSTALL": "0"})
    assert out.split() == ["MANAGER", "megatron.core.transformer.moe.token_dispatcher", "MANAGER", "megatron_ep.megatron.hybridep_manager"]
    assert "MANAGER megatron_ep." in _run("import megatron_ep.megatron; " + PROBE, env={"MEGATRON_EP_INSTALL": "1"})
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        {PROBE}
        print('ARGV', sys.argv[1:], __name__)
    """))
    out = _run(None, args=("-m", "megatron_ep.megatron.launch", str(script), "--moe-flex-dispatcher-backend", "hybridep"))
    assert "MANAGER megatron_ep." in out and "ARGV ['--moe-flex-dispatcher-backend', 'hybridep'] __main__" in out


def test_config_accessors_follow_the_installed_version():
    feats = compat.features()
    cfg16 = types.SimpleNamespace(moe_deepep_num_sms=20, moe_hybridep_num_sms=16)
    assert compat.flex_num_sms(cfg16, "deepep") == 20 and compat.flex_num_sms(cfg16, "hybridep") == 16
    cfg19 = types.SimpleNamespace(moe_flex_dispatcher_num_sms=24, moe_deepep_num_sms=None, moe_hybridep_num_sms=None)
    assert compat.flex_num_sms(cfg19, "deepep") == 24 and compat.flex_num_sms(cfg19, "hybridep") == 24
    assert compat.flex_num_sms(types.SimpleNamespace(moe_flex_dispatcher_num_sms=None), "hybridep") is None

    from megatron.core.transformer.transformer_config import TransformerConfig

    plain = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, num_moe_experts=4,
                              moe_router_topk=2, add_bias_linear=False, use_cpu_initialization=True)
    assert compat.quant_align(plain) == max(1, feats.align_default)
    if feats.permute_pads_segments:  # 0.19: DeepEP's permute pads to the quantization alignment itself
        assert compat.deepep_align(plain) == compat.quant_align(plain)
    else:  # 0.16: only with moe_router_padding_for_quantization
        assert compat.deepep_align(plain) == 1
        padded = copy.copy(plain)  # the config refuses the flag without FP8, which needs TE
        padded.moe_router_padding_for_quantization = True
        assert compat.deepep_align(padded) == 16
    if "moe_use_grouped_tensor" in feats.align_fields:  # main: TE's grouped-tensor experts want 256-row segments
        grouped = dataclasses.replace(plain, moe_grouped_gemm=True, moe_use_grouped_tensor=True)
        assert compat.quant_align(grouped) == 256 and compat.deepep_align(grouped) == 256
    assert (compat.rank_capacity_factor(types.SimpleNamespace(moe_expert_rank_capacity_factor=1.5)) == 1.5) == feats.rank_capacity_factor


def test_with_experts_rewrites_both_spec_styles():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mlp = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False).submodules.mlp
    sentinel = type("Experts", (), {})
    new = compat.with_experts(mlp, sentinel)
    assert compat.moe_submodules(new).experts is sentinel
    assert compat.moe_submodules(mlp).experts is not sentinel  # the original spec is untouched
    assert compat.moe_submodules(new).router is compat.moe_submodules(mlp).router


def test_backend_choice(monkeypatch):
    import torch

    from megatron_ep.megatron.buffers import choose_backend

    monkeypatch.delenv("MEGATRON_EP_BACKEND", raising=False)
    assert choose_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("MEGATRON_EP_BACKEND", "cuda")
    with pytest.raises(ValueError, match="not on a GPU"):
        choose_backend(torch.device("cpu"))
    monkeypatch.setenv("MEGATRON_EP_BACKEND", "nccl")
    with pytest.raises(ValueError, match=r"MEGATRON_EP_BACKEND='nccl' names no backend: use one of torch, cuda, auto"):
        choose_backend(torch.device("cpu"))


def _launch(tmp_path, *args):
    """The launcher with `args`, "SCRIPT" standing for a script that prints SCRIPT RAN."""
    script = tmp_path / "train.py"
    script.write_text("print('SCRIPT RAN')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    i = args.index("SCRIPT")
    cmd = [sys.executable, "-m", "megatron_ep.megatron.launch", *args[:i], str(script), *args[i + 1:]]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_launcher_refuses_hybridep_options_for_other_dispatchers(tmp_path):
    """--ep-budget / --ep-chunks act on the hybridep manager only: the launcher refuses them in one
    line, before the script runs, when the script's arguments pick another dispatcher (deepep,
    Megatron's default flex backend, or alltoall); with hybridep the script runs."""
    flex = ("--moe-token-dispatcher-type", "flex")
    for args, named in [
        (("--ep-budget", "1.5", "SCRIPT", *flex, "--moe-flex-dispatcher-backend", "deepep"), "--ep-budget"),
        (("--ep-budget", "1.5", "SCRIPT", *flex), "--moe-flex-dispatcher-backend deepep"),
        (("--ep-experts", "grouped", "--ep-chunks", "2", "SCRIPT", "--moe-token-dispatcher-type", "alltoall"), "--ep-chunks"),
    ]:
        out = _launch(tmp_path, *args)
        assert out.returncode == 2 and "SCRIPT RAN" not in out.stdout, (args, out.stdout, out.stderr)
        assert named in out.stderr and "hybridep" in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = _launch(tmp_path, "--ep-budget", "1.5", "SCRIPT", *flex, "--moe-flex-dispatcher-backend=hybridep")
    assert out.returncode == 0 and "SCRIPT RAN" in out.stdout, out.stderr[-2000:]


def test_chunk_count_is_bounded(tmp_path):
    """Every chunk is a dispatch and a combine, also an empty one: more than MAX_CHUNKS cannot
    help, and every entry refuses it (the launcher in one line, the library with ValueError)."""
    from megatron_ep.experts.overlap import MAX_CHUNKS
    from megatron_ep.megatron.layer_options import use_in_moe_layers

    out = _launch(tmp_path, "--ep-experts", "grouped", "--ep-chunks", "1000", "SCRIPT",
                  "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep")
    assert out.returncode == 2 and f"in [1, {MAX_CHUNKS}], got 1000" in out.stderr, out.stderr
    with pytest.raises(ValueError, match=f"chunks=1000 is above {MAX_CHUNKS}"):
        use_in_moe_layers("grouped", chunks=1000)


def test_deepep_manager_refuses_a_static_budget(monkeypatch):
    """MEGATRON_EP_RANK_CAPACITY_FACTOR (what --ep-budget sets) with the deepep manager, which has
    no static budget: refused at its construction, naming the variable, not ignored."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ep.megatron.deepep_manager import MegatronEPDeepepManager

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, num_moe_experts=4,
                            moe_router_topk=2, add_bias_linear=False, use_cpu_initialization=True)
    MegatronEPDeepepManager(None, 2, 2, 4, cfg)  # unset: fine
    monkeypatch.setenv("MEGATRON_EP_RANK_CAPACITY_FACTOR", "1.5")
    with pytest.raises(ValueError, match="MEGATRON_EP_RANK_CAPACITY_FACTOR=1.5 .*flex backend is deepep"):
        MegatronEPDeepepManager(None, 2, 2, 4, cfg)


BAD_ENVIRONMENT = [  # every variable the managers, their Buffers and chunked experts read after install()
    ("MEGATRON_EP_BACKEND", "xyz", "names no backend"),
    ("MEGATRON_EP_CHECK_INPUTS", "maybe", "is not a switch"),
    ("MEGATRON_EP_MAX_TOKENS_PER_RANK", "lots", "is not an integer"),
    ("MEGATRON_EP_COMBINE_ROWS", "0", "must be at least 1"),
    ("MEGATRON_EP_RANKS_PER_NODE", "-8", "must be at least 1"),
    ("MEGATRON_EP_RANK_CAPACITY_FACTOR", "0", "must be a finite number > 0"),
    ("MEGATRON_EP_CHUNKED_EXPERTS", "99", "must be at most 16"),
    ("MEGATRON_EP_GEMM_BACKEND", "cublas", "names no grouped GEMM backend"),
]


@pytest.mark.parametrize("name,value,why", BAD_ENVIRONMENT, ids=[b[0] for b in BAD_ENVIRONMENT])
def test_install_refuses_a_bad_variable(monkeypatch, name, value, why):
    """install() reads each variable the managers read later, through the same readers: a bad
    value raises there, naming it, and nothing is rebound (not at the first dispatch, deep in a
    training run)."""
    mm.uninstall()
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}.*{why}"):
        mm.install()
    assert not mm.is_installed()
    monkeypatch.delenv(name)
    mm.install()  # as the other tests of this file leave it
