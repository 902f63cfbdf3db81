"""The routed-expert GEMMs on one GPU, through megatron_ep.experts: the expert MLP (fc1 with SwiGLU,
fc2) forward and forward + backward over the expert-major layout our dispatch delivers, and the
masked GEMMs of the low-latency layout at decode shapes, for each GEMM backend, in TFLOP/s beside
dense GEMMs of the same GPU measured in the same run.

    python3 scripts/bench gemm --markdown gemm.md --json gemm.json     # DeepSeek-V3 shapes
    python3 scripts/bench gemm --experts 2 --hidden 256 --ffn 128 --tokens 64 --cpu   # smoke

Shapes: H = --hidden, expert FFN = --ffn (fc1 [G, 2F, H], fc2 [G, H, F]); a rank holding G local
experts of --total-experts receives --tokens x --topk rows when routing is balanced (EP =
total / G ranks each send tokens x topk rows, spread over all experts), so every row count here is
tokens x topk, split over the G experts: "balanced" evenly, "skewed" by a Zipf law (expert e's share
proportional to 1 / (e + 1)). Each segment is padded to DeepGEMM's M alignment (128 rows, pad rows
-1 in m_indices), as our dispatch pads it; FLOPs count the real rows only. Backward (dgrad and
wgrad) is 2x the forward FLOPs.

Backends: deepgemm (DeepGEMM's bf16 contiguous GEMMs forward and dgrad, wgrad on torch's
grouped_mm: megatron_ep.experts.backends), deepgemm-fp8 (forward GEMMs only: DeepGEMM's FP8
contiguous GEMM on FP8 rows with per-128 scales, the weights cast once per 128x128 block outside
the timing, and, separately, DeepGEMM's re-layout of our row-major scales into its MN-major,
TMA-aligned layout), grouped_mm (torch._grouped_mm), loop (one cuBLAS GEMM per expert). Decode:
[G, max_m, H] with max_m = --decode-tokens x EP rows per expert, masked_m = the balanced share
(decode tokens x topk x EP / total experts), DeepGEMM's masked bf16 / FP8 GEMMs against the batched
matmul fallback.

DeepGEMM compiles each kernel at its first call (JIT, into DG_JIT_CACHE_DIR): --jit-jobs N first runs
every case once in N processes at a time, so the compiles overlap, and that time is printed apart.
Timing: CUDA events around each call, --warmup untimed calls, the median of --iters.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from bench import harness  # noqa: E402  (sets the NCCL environment before torch loads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_ep.tools.cli import ArgumentParser  # noqa: E402
from megatron_ep.experts import (GroupedLayout, grouped_linear, grouped_linear_fp8, grouped_linear_masked,  # noqa: E402
                                 per_block_cast_to_fp8)
from megatron_ep.experts import backends as B  # noqa: E402
from megatron_ep.experts import fp8_weights  # noqa: E402
from megatron_ep.core.fp8 import per_token_cast_to_fp8  # noqa: E402
from megatron_ep.core.permute import padded_host_counts  # noqa: E402

BACKENDS = ("deepgemm", "deepgemm-fp8", "grouped_mm", "loop")
DECODE = ("deepgemm", "deepgemm-fp8", "torch")
ALIGN = 128  # DeepGEMM's M alignment of the contiguous layout (its get_mk_alignment_for_contiguous_layout)


def parse(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="scripts/bench gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048, help="expert FFN size F (fc1 has 2F outputs: SwiGLU)")
    p.add_argument("--experts", default="4,8,32,128", help="local expert counts G (EP = total / G)")
    p.add_argument("--skewed-experts", default="8,32", help="G values also run with Zipf-skewed counts")
    p.add_argument("--total-experts", type=int, default=256)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=128, help="decode tokens per rank (masked GEMMs)")
    p.add_argument("--decode-experts", default="8,32")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--jit-jobs", type=int, default=0, help="compile DeepGEMM's kernels in N processes first")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one case, for --jit-jobs
    p.add_argument("--cpu", action="store_true", help="run on CPU (a smoke test of the script: no figures)")
    p.add_argument("--markdown", default=None)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def ints(text: str) -> list:
    return [int(v) for v in text.split(",") if v.strip()]


def counts_for(G: int, rows: int, skew: str) -> list:
    """rows split over G experts: evenly, or by a Zipf law (share of expert e ~ 1 / (e + 1))."""
    if skew == "balanced":
        return [rows // G + (1 if e < rows % G else 0) for e in range(G)]
    w = [1.0 / (e + 1) for e in range(G)]
    raw = [rows * x / sum(w) for x in w]
    out = [int(r) for r in raw]
    for e in sorted(range(G), key=lambda e: out[e] - raw[e])[:rows - sum(out)]:
        out[e] += 1
    return out


def cases(a) -> list:
    out = []
    for G in ints(a.experts):
        for skew in ("balanced", "skewed") if G in ints(a.skewed_experts) else ("balanced",):
            for b in a.backends.split(","):
                out.append(("mlp", G, skew, b))
    for G in ints(a.decode_experts):
        for b in DECODE:
            if b == "torch" or b in a.backends.split(","):
                out.append(("decode", G, "balanced", b))
    return out


def case_id(c) -> str:
    return ":".join(str(v) for v in c)


def timed(fn, warmup: int, iters: int, device) -> float:
    """Median µs of fn over iters calls: the benchmarks' CUDA-event timer on a GPU, the wall
    clock on CPU (a smoke run)."""
    if device.type == "cuda":
        return harness.median_us(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def mlp_operands(a, G: int, skew: str, device):
    rows = a.tokens * a.topk
    counts = counts_for(G, rows, skew)
    padded = padded_host_counts(counts, ALIGN)
    M = sum(padded)
    row_expert = torch.full((M,), -1, dtype=torch.int32)
    start = 0
    for e, (c, p) in enumerate(zip(counts, padded)):
        row_expert[start:start + c] = e
        start += p
    g = torch.Generator().manual_seed(G)
    x = torch.randn((M, a.hidden), generator=g).to(torch.bfloat16) * (row_expert >= 0).unsqueeze(1)
    w1 = (torch.randn((G, 2 * a.ffn, a.hidden), generator=g) / a.hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn((G, a.hidden, a.ffn), generator=g) / a.ffn ** 0.5).to(torch.bfloat16)
    layout = GroupedLayout(torch.tensor(padded, device=device), M, row_expert.to(device), ALIGN)
    return counts, layout, x.to(device), w1.to(device), w2.to(device)


def run_mlp(a, G: int, skew: str, backend: str, device) -> dict:
    counts, layout, x, w1, w2 = mlp_operands(a, G, skew, device)
    real = sum(counts)
    fwd_flops = 6 * real * a.hidden * a.ffn  # fc1 (2F outputs) + fc2
    res = dict(kind="mlp", G=G, ep=a.total_experts // G, skew=skew, backend=backend, rows=real,
               padded_rows=layout.num_rows, max_rows=max(counts), min_rows=min(counts), fwd_gflop=fwd_flops / 1e9)
    if backend == "deepgemm-fp8":
        dg = B.deep_gemm_module()
        xq = per_token_cast_to_fp8(x)
        w1q, w2q = per_block_cast_to_fp8(w1), per_block_cast_to_fp8(w2)
        h = torch.randn((layout.num_rows, a.ffn), device=device).to(torch.bfloat16)
        hq = per_token_cast_to_fp8(h)
        m_idx = layout.m_indices(device)
        d1 = torch.empty((layout.num_rows, 2 * a.ffn), dtype=torch.bfloat16, device=device)
        d2 = torch.empty((layout.num_rows, a.hidden), dtype=torch.bfloat16, device=device)

        def fwd():
            dg.m_grouped_fp8_gemm_nt_contiguous(xq, w1q, d1, m_idx)
            dg.m_grouped_fp8_gemm_nt_contiguous(hq, w2q, d2, m_idx)

        res["fwd_us"] = timed(fwd, a.warmup, a.iters, device)
        # DeepGEMM re-lays the per-token scales (ours: row-major [M, K/128]) into MN-major, TMA-aligned
        res["scale_relayout_us"] = timed(lambda: dg.get_mn_major_tma_aligned_tensor(xq[1]), a.warmup, a.iters, device)
        res["activation_cast_us"] = timed(lambda: per_token_cast_to_fp8(h), a.warmup, a.iters, device)
        # fc1 through our glue (megatron_ep.experts.grouped_linear_fp8): inside fp8_weights.frozen() the weights'
        # FP8 cast is made at the first call and reused (decode, micro-batches between optimizer steps); by
        # default it is made at every call
        with fp8_weights.frozen():
            res["glue_fc1_us"] = timed(lambda: grouped_linear_fp8(xq, w1, layout, "deepgemm"), a.warmup, a.iters, device)
        res["glue_fc1_uncached_us"] = timed(lambda: grouped_linear_fp8(xq, w1, layout, "deepgemm"), a.warmup, a.iters,
                                            device)
        res["fc1_us"] = timed(lambda: dg.m_grouped_fp8_gemm_nt_contiguous(xq, w1q, d1, m_idx), a.warmup, a.iters, device)
    else:
        if backend == "deepgemm" and B.deep_gemm_module() is None:
            raise RuntimeError("deep_gemm does not import: build it (scripts/env/build_deepgemm.sh) or leave deepgemm out of --backends")
        probs = torch.ones((layout.num_rows,), device=device)

        def mlp(xx, a1, a2):
            h = grouped_linear(xx, a1, layout, backend)
            h1, h2 = h.chunk(2, dim=-1)
            h = (F.silu(h1) * h2 * probs.unsqueeze(-1)).to(xx.dtype)
            return grouped_linear(h, a2, layout, backend)

        with torch.no_grad():
            res["fwd_us"] = timed(lambda: mlp(x, w1, w2), a.warmup, a.iters, device)
        xs, a1, a2 = (t.detach().requires_grad_(True) for t in (x, w1, w2))
        grad = torch.randn_like(x)

        def fwd_bwd():
            for t in (xs, a1, a2):
                t.grad = None
            mlp(xs, a1, a2).backward(grad)

        res["fwd_bwd_us"] = timed(fwd_bwd, a.warmup, a.iters, device)
        res["fwd_bwd_tflops"] = 3 * fwd_flops / res["fwd_bwd_us"] / 1e6
        res["bwd_tflops"] = 2 * fwd_flops / max(res["fwd_bwd_us"] - res["fwd_us"], 1e-9) / 1e6
    res["fwd_tflops"] = fwd_flops / res["fwd_us"] / 1e6
    return res


def run_decode(a, G: int, backend: str, device) -> dict:
    ep = a.total_experts // G
    max_m = a.decode_tokens * ep
    m = max(1, a.decode_tokens * a.topk * ep // a.total_experts)
    g = torch.Generator().manual_seed(100 + G)
    x = torch.randn((G, max_m, a.hidden), generator=g).to(torch.bfloat16).to(device)
    w1 = (torch.randn((G, 2 * a.ffn, a.hidden), generator=g) / a.hidden ** 0.5).to(torch.bfloat16).to(device)
    masked_m = torch.full((G,), m, dtype=torch.int32, device=device)
    flops = 2 * G * m * a.hidden * 2 * a.ffn  # fc1 alone: the decode layer's larger GEMM
    saved = (B._deep_gemm, B._deep_gemm_checked)
    if backend == "torch":
        B._deep_gemm, B._deep_gemm_checked = None, True
    elif B.deep_gemm_module() is None:
        raise RuntimeError("deep_gemm does not import")
    try:
        xin = per_token_cast_to_fp8(x.view(-1, a.hidden)) if backend == "deepgemm-fp8" else x
        if backend == "deepgemm-fp8":
            xin = (xin[0].view(G, max_m, a.hidden), xin[1].view(G, max_m, -1))
        uncached_us = None
        with torch.no_grad():
            if backend == "deepgemm-fp8":  # decode keeps its weights: their FP8 cast made once (fp8_weights.frozen())
                with fp8_weights.frozen():
                    us = timed(lambda: grouped_linear_masked(xin, w1, masked_m, expected_m=m), a.warmup, a.iters, device)
                uncached_us = timed(lambda: grouped_linear_masked(xin, w1, masked_m, expected_m=m), a.warmup, a.iters,
                                    device)
            else:
                us = timed(lambda: grouped_linear_masked(xin, w1, masked_m, expected_m=m), a.warmup, a.iters, device)
        gemm_us = None
        if backend != "torch":  # DeepGEMM's kernel alone, the weights cast beforehand (max_m: a multiple of 128)
            dg = B.deep_gemm_module()
            d = torch.empty((G, max_m, 2 * a.ffn), dtype=torch.bfloat16, device=device)
            if backend == "deepgemm-fp8":
                w1q = per_block_cast_to_fp8(w1)
                gemm_us = timed(lambda: dg.m_grouped_fp8_gemm_nt_masked(xin, w1q, d, masked_m, m), a.warmup, a.iters, device)
            else:
                gemm_us = timed(lambda: dg.m_grouped_bf16_gemm_nt_masked(x, w1, d, masked_m, m), a.warmup, a.iters, device)
    finally:
        B._deep_gemm, B._deep_gemm_checked = saved
    # at decode the GEMM reads each weight once for a few rows: HBM bandwidth over the weights is its yardstick
    weight_bytes = G * 2 * a.ffn * a.hidden * (1 if backend == "deepgemm-fp8" else 2)
    return dict(kind="decode", G=G, ep=ep, skew="balanced", backend=backend, max_m=max_m, masked_m=m,
                fwd_us=us, fwd_tflops=flops / us / 1e6, gflop=flops / 1e9, gemm_us=gemm_us,
                gemm_tflops=flops / gemm_us / 1e6 if gemm_us else None, uncached_us=uncached_us,
                weight_bytes=weight_bytes, gemm_tbps=weight_bytes / gemm_us / 1e6 if gemm_us else None)


def dense_peaks(device, warmup: int, iters: int) -> dict:
    """Dense bf16 (torch.mm) and FP8 (torch._scaled_mm) GEMMs of n^3 (8192 on a GPU), TFLOP/s."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn((n, n), device=device).to(torch.bfloat16)
    b = torch.randn((n, n), device=device).to(torch.bfloat16)
    out = {"n": n, "bf16": 2 * n ** 3 / timed(lambda: a @ b, warmup, iters, device) / 1e6}
    if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
        qa, qb = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        out["fp8"] = 2 * n ** 3 / timed(lambda: torch._scaled_mm(qa, qb, one, one, out_dtype=torch.bfloat16),
                                        warmup, iters, device) / 1e6
    return out


def run_case(a, c, device) -> dict:
    kind, G, skew, backend = c
    if kind == "mlp":
        return run_mlp(a, G, skew, backend, device)
    return run_decode(a, G, backend, device)


def jit_warm(a, todo: list) -> float:
    """Each DeepGEMM case once, in a.jit_jobs processes at a time (their compiles overlap)."""
    t0 = time.time()
    base = [sys.executable, os.path.dirname(os.path.abspath(__file__)), "gemm", "--warmup", "0", "--iters", "1"]
    for k in ("hidden", "ffn", "total_experts", "tokens", "topk", "decode_tokens"):
        base += [f"--{k.replace('_', '-')}", str(getattr(a, k))]

    def one(c):
        r = subprocess.run(base + ["--only", case_id(c)], capture_output=True, text=True)
        return c, r.returncode, (r.stdout + r.stderr)[-2000:]

    with concurrent.futures.ThreadPoolExecutor(a.jit_jobs) as pool:
        for c, rc, tail in pool.map(one, todo):
            if rc:
                print(f"[jit] {case_id(c)} failed (rc {rc}):\n{tail}", file=sys.stderr)
    return time.time() - t0


def table(meta: dict, rows: list) -> str:
    peak = meta["dense_tflops"]
    out = [f"Expert GEMMs, {meta['machine']}, {meta['date']}, commit {meta['commit']}, deep_gemm {meta['deep_gemm']}, "
           f"torch {meta['torch']}: `{meta['command']}`", "",
           f"Dense GEMMs of {peak['n']}^3 in the same run: bf16 {peak.get('bf16', 0):.0f} TFLOP/s"
           + (f", FP8 {peak['fp8']:.0f} TFLOP/s" if "fp8" in peak else "") + ".", "",
           f"Expert MLP (H {meta['hidden']}, F {meta['ffn']}, SwiGLU; {meta['tokens']} tokens x top-{meta['topk']} rows per rank):", "",
           "| G (EP) | counts | backend | rows (max/min per expert) | forward µs | forward TFLOP/s | fwd+bwd µs | fwd+bwd TFLOP/s | backward TFLOP/s |",
           "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("kind") != "mlp":
            continue
        fb = f"{r['fwd_bwd_us']:.0f} | {r['fwd_bwd_tflops']:.0f} | {r['bwd_tflops']:.0f}" if "fwd_bwd_us" in r else "- | - | -"
        out.append(f"| {r['G']} ({r['ep']}) | {r['skew']} | {r['backend']} | {r['rows']} ({r['max_rows']}/{r['min_rows']}) | "
                   f"{r['fwd_us']:.0f} | {r['fwd_tflops']:.0f} | {fb} |")
    fp8 = [r for r in rows if r.get("backend") == "deepgemm-fp8" and r.get("kind") == "mlp"]
    if fp8:
        out += ["", "deepgemm-fp8 is the two forward GEMMs alone; beside them, per call: "
                + "; ".join(f"G {r['G']} {r['skew']}: DeepGEMM's re-layout of our scales {r['scale_relayout_us']:.1f} µs, "
                            f"the torch cast of fc2's input {r['activation_cast_us']:.0f} µs, "
                            f"fc1 through grouped_linear_fp8 {r['glue_fc1_us']:.0f} µs (its weights' cast cached: fp8_weights.frozen(); "
                            f"{r.get('glue_fc1_uncached_us', 0):.0f} µs casting them at each call) against "
                            f"{r['fc1_us']:.0f} µs for its GEMM"
                            for r in fp8) + "."]
    dec = [r for r in rows if r.get("kind") == "decode"]
    if dec:
        out += ["", f"Masked GEMMs at decode ({meta['decode_tokens']} tokens per rank; fc1, [G, max_m, {meta['hidden']}] x [G, {2 * meta['ffn']}, {meta['hidden']}]):", "",
                "| G (EP) | max_m | masked_m | backend | grouped_linear_masked µs | the GEMM alone µs | weights MB | "
                "the GEMM's TB/s over them |",
                "|---|---:|---:|---|---:|---:|---:|---:|"]
        for r in dec:
            alone = f"{r['gemm_us']:.0f}" if r.get("gemm_us") else "-"
            tbps = f"{r['gemm_tbps']:.2f}" if r.get("gemm_tbps") else "-"
            glue = f"{r['fwd_us']:.0f}" + (f" ({r['uncached_us']:.0f} casting the weights)" if r.get("uncached_us") else "")
            out.append(f"| {r['G']} ({r['ep']}) | {r['max_m']} | {r['masked_m']} | {r['backend']} | {glue} | {alone} | "
                       f"{r['weight_bytes'] / 1e6:.0f} | {tbps} |")
        out += ["", "grouped_linear_masked is our glue (rows past masked_m zeroed; FP8: the weights' 128x128-block cast kept "
                "inside fp8_weights.frozen(), in parentheses made at each call); the GEMM alone is DeepGEMM's masked kernel "
                "with the weights cast beforehand. At decode the weights dominate the bytes: TB/s over them is the yardstick."]
    failed = [r for r in rows if "error" in r]
    if failed:
        out += ["", "Failed: " + "; ".join(f"{r['case']}: {r['error']}" for r in failed)]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    device = torch.device("cpu" if a.cpu else "cuda")
    if not a.cpu and not torch.cuda.is_available():
        print("no CUDA GPU here: run on the GPU machine (or --cpu for a smoke run)", file=sys.stderr)
        return 2
    if a.cpu:
        a.backends = ",".join(b for b in a.backends.split(",") if b == "loop")
    todo = cases(a) if not a.cpu else [c for c in cases(a) if c[0] == "mlp"]
    if a.only:
        c = next(c for c in todo if case_id(c) == a.only)
        run_case(a, c, device)
        return 0
    # the dense peaks first: a run cut short at its time limit still has its yardstick
    peaks = dense_peaks(device, a.warmup, a.iters)
    print(json.dumps(dict(dense_tflops=peaks)), flush=True)
    jit_s = 0.0
    if a.jit_jobs and B.deep_gemm_module() is not None:
        jit_s = jit_warm(a, [c for c in todo if c[3].startswith("deepgemm")])
        print(f"DeepGEMM JIT: every case once in {a.jit_jobs} processes: {jit_s:.0f} s", flush=True)
    rows = []
    for c in todo:
        try:
            r = run_case(a, c, device)
        except Exception as e:  # one failing backend must not hide the others' figures
            r = dict(case=case_id(c), error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(json.dumps(r), flush=True)
        rows.append(r)
    dg = B.deep_gemm_module()
    rev = os.environ.get("MEP_DEEPGEMM_REVISION") or getattr(dg, "__version__", "none")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                commit=os.environ.get("MEP_GATE_COMMIT") or subprocess.run(["git", "rev-parse", "--short=12", "HEAD"],
                                                                           capture_output=True, text=True).stdout.strip(),
                machine=torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run: no figures)",
                torch=torch.__version__, deep_gemm=rev, command="python3 scripts/bench gemm " + " ".join(argv or sys.argv[1:]),
                hidden=a.hidden, ffn=a.ffn, tokens=a.tokens, topk=a.topk, decode_tokens=a.decode_tokens,
                total_experts=a.total_experts, jit_seconds=round(jit_s), dense_tflops=peaks)
    text = table(meta, rows)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
