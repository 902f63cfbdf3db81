"""The benchmarks' shared code; scripts/bench_normal.py and scripts/bench_low_latency.py are
thin entry points over it, and scripts/ab_throughput.py uses its report writer.

    harness       process set-up (ranks, GPUs, ports), timing (CUDA events, warm-up, medians),
                  torch.profiler kernel times, CUDA graphs
    internals     the only place benchmarks touch megatron_ep internals (phase trace, pool
                  counters, the notify kernel alone, low-latency trace stamps)
    report        markdown tables, the --markdown / --json files, the code revision
    baselines     single-process baselines: the device copy (HBM roofline), the permute
    megatron_ops  megatron-core's moe_utils permute / unpermute / sort_chunks (or a copy)
    nccl          NCCL all-to-all baselines (Megatron's alltoall dispatcher, plain all-to-alls)
    deepep        DeepEP V1 (intranode and low-latency kernels), when `deep_ep` imports
    normal        the normal-path bench body (scripts/bench_normal.py)
    normal_report its console tables and markdown table
    model_check   its internode model check (megatron_ep.tools.model against the run)
    low_latency   the low-latency bench body and tables (scripts/bench_low_latency.py)

The entry points put this folder's parent (scripts/) and the checkout on sys.path;
`python3 scripts/bench NAME` (this folder's __main__.py) runs any of them by name.
"""
