"""install() / activation paths and the megatron-core version detection (single process)."""

import os
import subprocess
import sys
import textwrap
import types

import pytest

import megatron.core  # noqa: E402,F401  (CI installs megatron-core: a missing one must fail, not skip)

import megatron_ep.megatron as mm  # noqa: E402
from megatron_ep.megatron import compat  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    assert feats.version.startswith(("0.16", "0.17", "0.18", "0.19"))
    mm.uninstall()
    assert (td._DeepepManager, td._HybridEPManager) == original
    mm.install()


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

    plain = types.SimpleNamespace(fp8=None, fp4=None, use_transformer_engine_op_fuser=False, moe_router_padding_for_quantization=False)
    assert compat.quant_align(plain) == max(1, feats.align_default)
    if feats.permute_pads_segments:  # 0.19: DeepEP's permute pads to the quantization alignment itself
        assert compat.deepep_align(plain) == compat.quant_align(plain)
    else:  # 0.16: only with moe_router_padding_for_quantization
        assert compat.deepep_align(plain) == 1
        assert compat.deepep_align(types.SimpleNamespace(**{**vars(plain), "moe_router_padding_for_quantization": True})) == 16
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
    with pytest.raises(ValueError, match="must be torch, cuda or auto"):
        choose_backend(torch.device("cpu"))
