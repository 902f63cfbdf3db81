"""The benchmarks, each run by name through this folder's __main__.py (`python3 scripts/bench
NAME`; scripts/ab_throughput.py, the A/B runs, is the one entry outside it), and their shared
code.

Benchmarks (`scripts/bench NAME`):
    normal        the normal paths' kernels against NCCL, DeepEP and the copy roofline
    low_latency   the low-latency (decode) path, against DeepEP's (`low-latency`)
    host          host cost per call, natively, through megatron_ep.deep_ep and DeepEP V1
    overlap       chunked experts against one round: the forward timeline and the model
    link          the NVLink roofline between two GPUs
    gemm          the routed-expert GEMMs

Shared code:
    harness       process set-up (ranks, GPUs, ports), timing (CUDA events, warm-up, medians),
                  torch.profiler kernel times, CUDA graphs
    internals     the only place benchmarks touch megatron_ep internals (phase trace, pool
                  counters, the notify kernel alone, low-latency trace stamps)
    report        markdown tables, the --markdown / --json files, the code revision
    baselines     single-process baselines: the device copy (HBM roofline), the permute
    megatron_ops  megatron-core's moe_utils permute / unpermute / sort_chunks (or a copy)
    nccl          NCCL all-to-all baselines (Megatron's alltoall dispatcher, plain all-to-alls)
    deepep        DeepEP V1 (intranode and low-latency kernels), when `deep_ep` imports
    normal_report the normal bench's console tables and markdown table
    model_check   its internode model check (megatron_ep.tools.model against the run)
    host_canned   the host bench's --canned run (our calls' Python over recorded crossings)

__main__.py puts the checkout and scripts/ first on sys.path, so the benchmarks import this
package as `bench`; a benchmark runs as the main module, as a script would.
"""
