"""megatron_ep.megatron.decode: a real megatron-core MoELayer (sigmoid group-limited router with
expert bias, shared expert, SwiGLU experts) whose decode step runs on the low-latency path
(torch backend, 2 gloo processes) against the same layer's own forward: fp32 to 1e-5, bf16 to
2e-2 of the output's magnitude. A rank without tokens, router-dropped (-1) slots, Megatron's
SequentialMLP, 0.16's legacy GroupedMLP (grouped_gemm's gmm stood in by a loop) and megatron_ep's
GroupedGemmExperts; and the inference-context hook's agreement over the EP group."""

import pytest

import megatron.core  # noqa: F401  (CI installs megatron-core: a missing one must fail, not skip)

import decode_cases as dc
from distpool import flat


def _has_legacy_grouped_mlp() -> bool:
    from megatron.core.transformer.moe import experts

    return hasattr(experts, "GroupedMLP")


def test_decode_matches_megatron_forward(pools):
    R = 2
    variants = [("flex", "deepep", "sequential", "fp32"), ("flex", "hybridep", "grouped", "fp32"),
                ("alltoall", "deepep", "sequential", "fp32"), ("flex", "deepep", "sequential", "bf16")]
    if _has_legacy_grouped_mlp():
        variants.append(("flex", "hybridep", "legacy", "bf16"))
    errors = []
    # S tokens per rank (x batch 2); the last rank has none in the second case
    for i, (S, cap) in enumerate([([3, 5], None), ([4, 0], 0.5)]):
        case = dict(seed=70 + i, E=4 * R, K=3, H=16, F=8, S=S, max_tokens=16, capacity_factor=cap, variants=variants)
        errors += flat(pools(R).run(dc.run_decode_vs_normal, case))
    assert not errors, "\n".join(errors[:20])


def test_decode_follows_inference_context(pools):
    case = dict(seed=90, E=8, K=2, H=16, F=8, max_tokens=8)
    errors = flat(pools(2).run(dc.run_decode_context_hook, case))
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("glu", [True, False])
def test_expert_weights_layouts(glu):
    """expert_weights() reads each Megatron experts layout as [L, F|2F, H] / [L, H, F]."""
    import types

    import torch

    from megatron_ep.megatron.decode import expert_weights

    L, H, F = 3, 8, 4
    N = 2 * F if glu else F
    w1, w2 = torch.randn(L, N, H), torch.randn(L, H, F)
    legacy = types.SimpleNamespace(num_local_experts=L, weight1=torch.nn.Parameter(w1.transpose(1, 2).contiguous().view(H, L * N)),
                                   weight2=torch.nn.Parameter(w2.transpose(1, 2).contiguous().view(L * F, H)))
    lin = lambda w: types.SimpleNamespace(weight=torch.nn.Parameter(w.clone()), bias=None)  # noqa: E731
    seq = types.SimpleNamespace(num_local_experts=L, local_experts=[
        types.SimpleNamespace(linear_fc1=lin(w1[e]), linear_fc2=lin(w2[e])) for e in range(L)])
    te = types.SimpleNamespace(num_local_experts=L, linear_fc1=types.SimpleNamespace(**{f"weight{e}": w1[e] for e in range(L)}),
                               linear_fc2=types.SimpleNamespace(**{f"weight{e}": w2[e] for e in range(L)}))
    for name, mod in (("legacy GroupedMLP", legacy), ("SequentialMLP", seq), ("TEGroupedMLP", te)):
        a, b = expert_weights(mod, H)
        assert torch.equal(a, w1) and torch.equal(b, w2), name


def test_decode_recipe_runs():
    """recipes/decode_moe.py: a GPTModel's KV-cache decode step (Megatron's StaticInferenceContext)
    on the low-latency path via the inference-context hook, against Megatron's forward (2 gloo ranks)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, os.path.join(root, "recipes", "decode_moe.py"), "--nproc-per-node", "2"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "\nOK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 MoE layers on the low-latency path" in out.stdout, out.stdout[-3000:]


def test_decode_recipe_fp8_passes_its_own_default_tolerance():
    """recipes/decode_moe.py --fp8 at a hidden size FP8 takes: its default tolerance counts FP8's
    rounding (2^-4 for e4m3), and the run passes it; a tolerance below what FP8 rounding does
    fails, in one line that names the command once."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, os.path.join(root, "recipes", "decode_moe.py"), "--fp8", "--hidden", "128"]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "\nOK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    diff, tol = map(float, re.search(r"over ranks = (\S+) \(tolerance (\S+)\)", out.stdout).groups())
    assert tol == 1e-4 + 2 ** -4 and 1e-4 < diff < tol, out.stdout  # FP8 moved the logits past fp32's tolerance
    out = subprocess.run(cmd + ["--tol", f"{diff / 2:g}"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stderr.strip() == ("recipes/decode_moe.py: error: the decode step differs from Megatron's forward by "
                                  "more than the tolerance"), out.stderr


def test_stacked_expert_weights_follow_optimizer_writes():
    """A SequentialMLP's stacked decode weights follow a write that leaves the parameters' address
    and version as they were (what Megatron's optimizers do: `param.data.copy_`, or a write into
    a buffer the parameter views); with keep_weights they follow refresh_decode_weights' in-place
    re-stack, and stay the kept tensors."""
    import types

    import torch

    from megatron_ep.megatron.decode import DecodeState

    L, H, F = 2, 8, 4
    flat_buf = torch.randn(L * (2 * F * H + H * F))  # the optimizer's buffer the parameters view
    views, at = [], 0
    for shape in [(2 * F, H)] * L + [(H, F)] * L:
        n = shape[0] * shape[1]
        views.append(flat_buf[at:at + n].view(shape))
        at += n
    params = [torch.nn.Parameter(torch.empty(v.shape)) for v in views]
    for p, v in zip(params, views):
        p.data = v  # as Megatron's DDP points each parameter into its contiguous buffer
    lin = lambda w: types.SimpleNamespace(weight=w, bias=None)  # noqa: E731
    experts = types.SimpleNamespace(num_local_experts=L, local_experts=[
        types.SimpleNamespace(linear_fc1=lin(params[e]), linear_fc2=lin(params[L + e])) for e in range(L)])
    layer = types.SimpleNamespace(experts=experts, config=types.SimpleNamespace(hidden_size=H))

    def now():
        return torch.stack([p.detach() for p in params[:L]]), torch.stack([p.detach() for p in params[L:]])

    for keep in (False, True):
        st = DecodeState(16, False, None, None, None, keep_weights=keep)
        w1, w2 = st.weights(layer)
        assert torch.equal(w1, now()[0]) and torch.equal(w2, now()[1])
        before = [(p.data_ptr(), p._version) for p in params]
        params[0].data.copy_(torch.randn(2 * F, H))  # as an optimizer step writes
        flat_buf.mul_(0.5)                            # and through the buffer the parameters view
        assert [(p.data_ptr(), p._version) for p in params] == before  # nothing a key could see
        if keep:
            assert st.weights(layer)[0] is w1 and not torch.equal(w1, now()[0])  # kept: stale until refreshed
            st.refresh(layer)
            k1, k2 = st.weights(layer)
            assert k1 is w1 and k2 is w2, "the refresh must write into the kept tensors (CUDA graphs read them)"
        else:
            k1, k2 = st.weights(layer)
        assert torch.equal(k1, now()[0]) and torch.equal(k2, now()[1]), f"keep_weights={keep}: stale decode weights"


@pytest.mark.limit(120)
def test_decode_refusals_reach_every_rank(pools):
    """A decode step that a rank refuses (gradients on, more tokens than max_tokens_per_rank) or
    that only some ranks take: every rank raises within seconds (the refusing rank its own error,
    the others PeerFailedError or CallMismatchError), none waits for a peer; the layer works after."""
    case = dict(seed=95, E=8, K=2, H=16, F=8, max_tokens=8)
    errors = flat(pools(2).run(dc.run_decode_refusals, case))
    assert not errors, "\n".join(errors[:20])


def test_decode_follows_replaced_and_recast_weights(pools):
    """keep_weights=True with GroupedGemmExperts and SequentialMLP: replaced Parameters, a dtype
    change and an in-place update (then refresh_decode_weights) are each decoded as the layer's
    own forward computes them."""
    case = dict(seed=97, E=8, K=2, H=16, F=8, max_tokens=8)
    errors = flat(pools(2).run(dc.run_decode_weight_changes, case))
    assert not errors, "\n".join(errors[:20])
