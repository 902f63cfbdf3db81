#!/usr/bin/env python3
"""The NVLink roofline between two GPUs of this machine: what the copy engine and what SM-issued
stores reach, one direction and both at once (the dispatch's pattern: every rank sends while it
receives), at the SM counts our kernels run with.

One process, two GPUs (peer access), no megatron_ep: it measures the link, not our code.
Kernels (compiled at run time with NVRTC through CuPy, which the GPU image has):

  ce           torch's cross-device copy (cudaMemcpyPeerAsync: the copy engines)
  st           grid-stride copy, each thread issues U 16-byte loads then U stores to the peer
  rows         our rank-major push's pattern: a warp per 14336-byte row (+local: the row also to
               this GPU, +ids: 8 ids and 8 weights per row and destination too); 58 MB is 4096 rows
  tma          per block, 1D bulk copies (cp.async.bulk): global -> shared, shared -> peer,
               a pipeline of `stages` chunks in flight; one thread drives it
  local        the same `st` kernel into this GPU's own memory (the HBM copy, for scale)

Each figure: CUDA events around `--iters` back-to-back launches after a warm-up, median of
`--reps`; GB/s = bytes one GPU sends / time (both directions: each GPU's own bytes over the
slower GPU's time). Run on a machine with two GPUs:

    python3 scripts/bench link --mbytes 58 --sms 8,16,24,32,132
"""
import argparse
import statistics

import torch

SRC = r"""
extern "C" __global__ void st_copy(const int4* __restrict__ src, int4* dst, long long n16) {
  constexpr int U = 8;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long base = (long long)blockIdx.x * blockDim.x + threadIdx.x; base < n16; base += stride * U) {
    int4 v[U];
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (base + j * stride < n16) v[j] = __ldg(src + base + j * stride);
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (base + j * stride < n16) dst[base + j * stride] = v[j];
  }
}

// One thread per block drives `S` shared-memory stages of `chunk` bytes: chunk i of this block is
// loaded with a bulk copy (completion on an mbarrier), then stored to dst with a bulk copy
// (bulk group); a stage is reloaded once its store has read it.
template <int S>
__device__ void tma_body(const char* src, char* dst, long long nbytes, int chunk) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) unsigned long long bar[S];
  if (threadIdx.x != 0) return;
  const long long nchunks = nbytes / chunk;
  for (int s = 0; s < S; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"((unsigned)__cvta_generic_to_shared(&bar[s])));
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  unsigned phase = 0;  // bit s: parity to wait for on stage s
  auto load = [&](long long i, int s) {
    const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem + (long long)s * chunk);
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" :: "r"(b), "r"(chunk) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(d), "l"(src + i * chunk), "r"(chunk), "r"(b) : "memory");
  };
  long long it = 0;
  for (long long i = blockIdx.x; i < nchunks && it < S - 1; i += gridDim.x, ++it) load(i, (int)it);
  it = 0;
  for (long long i = blockIdx.x; i < nchunks; i += gridDim.x, ++it) {
    const int s = (int)(it % S);
    const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
    const unsigned par = (phase >> s) & 1u;
    asm volatile("{\n .reg .pred p;\n W:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
                 :: "r"(b), "r"(par) : "memory");
    phase ^= 1u << s;
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem + (long long)s * chunk);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst + i * chunk), "r"(d), "r"(chunk)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // the chunk S-1 ahead goes into the stage the previous store used, once that store read it
    const long long ahead = i + (long long)(S - 1) * gridDim.x;
    if (ahead < nchunks) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(ahead, (int)((it + S - 1) % S));
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// Our push's pattern (csrc/intranode/dispatch.cu, dispatch_push_kernel): a warp per row, U loads
// per lane then the stores to each destination; mode bit 0: also a local copy of the row (the
// sender's own rank), bit 1: also K 8-byte ids and K 4-byte weights per row and destination.
extern "C" __global__ void rows_copy(const int4* __restrict__ src, int4* remote, int4* local, long long* ids_r,
                                     long long* ids_l, int nrows, int n16, int mode) {
  constexpr int U = 8, K = 8;
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, tw = gridDim.x * (blockDim.x / 32);
  for (int r = gw; r < nrows; r += tw) {
    const int4* s = src + (long long)r * n16;
    for (int it = 0; it * 32 * U < n16; ++it) {
      const int base = it * 32 * U + lane;
      int4 v[U];
#pragma unroll
      for (int j = 0; j < U; ++j)
        if (base + j * 32 < n16) v[j] = __ldg(s + base + j * 32);
#pragma unroll
      for (int j = 0; j < U; ++j)
        if (base + j * 32 < n16) remote[(long long)r * n16 + base + j * 32] = v[j];
      if (mode & 1) {
#pragma unroll
        for (int j = 0; j < U; ++j)
          if (base + j * 32 < n16) local[(long long)r * n16 + base + j * 32] = v[j];
      }
    }
    if ((mode & 2) && lane < K) {
      ids_r[(long long)r * K + lane] = lane;
      reinterpret_cast<float*>(ids_r + (long long)nrows * K)[(long long)r * K + lane] = 1.f;
      if (mode & 1) {
        ids_l[(long long)r * K + lane] = lane;
        reinterpret_cast<float*>(ids_l + (long long)nrows * K)[(long long)r * K + lane] = 1.f;
      }
    }
  }
}
extern "C" __global__ void tma_copy4(const char* src, char* dst, long long nbytes, int chunk) { tma_body<4>(src, dst, nbytes, chunk); }
"""


def kernels():
    import cupy
    mod = cupy.RawModule(code=SRC, options=("-std=c++17",), name_expressions=None)
    return cupy, mod.get_function("st_copy"), mod.get_function("tma_copy4"), mod.get_function("rows_copy")


def main():
    p = argparse.ArgumentParser(prog="scripts/bench link", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbytes", type=float, default=58.0, help="bytes each GPU sends (MB); default: a 4096-token bf16 dispatch's remote rows at EP 2")
    p.add_argument("--sms", default="8,16,24,32,132")
    p.add_argument("--chunk", type=int, default=16384, help="tma: bytes per bulk copy (4 stages in shared memory)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    assert torch.cuda.device_count() >= 2, "needs two GPUs"
    assert torch.cuda.can_device_access_peer(0, 1), "GPUs 0 and 1 have no peer access"
    n = int(a.mbytes * 1e6) // a.chunk * a.chunk
    cupy, st, tma, rows = kernels()
    row_bytes = 14336  # a bf16 row of hidden 7168
    nrows = n // row_bytes
    src = [torch.randn(n // 2, dtype=torch.bfloat16, device=f"cuda:{d}") for d in (0, 1)]
    dst = [torch.empty(n // 2, dtype=torch.bfloat16, device=f"cuda:{d}") for d in (0, 1)]
    dst_local = [torch.empty(n // 2, dtype=torch.bfloat16, device=f"cuda:{d}") for d in (0, 1)]
    ids = [torch.empty(n // row_bytes * 8 * 3 // 2 + 8, dtype=torch.int64, device=f"cuda:{d}") for d in (0, 1)]
    for d in (0, 1):  # the peer mappings SM stores need (torch enables them lazily for copies)
        with cupy.cuda.Device(d):
            try:
                cupy.cuda.runtime.deviceEnablePeerAccess(1 - d)
            except cupy.cuda.runtime.CUDARuntimeError:
                pass  # already enabled
    streams = [torch.cuda.Stream(device=d) for d in (0, 1)]
    # per device, once (not inside the timed launches): CuPy's view of each stream, and the bulk
    # copy kernel's shared-memory opt-in (each device loads its own copy of the module)
    cupy_streams = [cupy.cuda.ExternalStream(streams[d].cuda_stream, d) for d in (0, 1)]  # (deprecated name; still there)
    for d in (0, 1):
        with cupy.cuda.Device(d):
            tma.max_dynamic_shared_size_bytes = 4 * a.chunk

    def launch(kind, d, to, sms):
        """One copy from GPU d's src into GPU `to`'s dst, on GPU d's stream."""
        s, t = src[d], dst[to]
        with torch.cuda.device(d), torch.cuda.stream(streams[d]):
            if kind == "ce":
                t.copy_(s, non_blocking=True)
                return
            with cupy.cuda.Device(d), cupy_streams[d]:
                if kind in ("st", "local"):
                    st((sms,), (512,), (s.data_ptr(), t.data_ptr(), cupy.int64(n // 16)))
                elif kind.startswith("rows"):
                    mode = {"rows": 0, "rows+local": 1, "rows+local+ids": 3}[kind]
                    rows((sms,), (512,), (s.data_ptr(), t.data_ptr(), dst_local[d].data_ptr(), ids[to].data_ptr(),
                                          ids[d].data_ptr(), cupy.int32(nrows), cupy.int32(row_bytes // 16),
                                          cupy.int32(mode)))
                else:
                    tma((sms,), (32,), (s.data_ptr(), t.data_ptr(), cupy.int64(n), cupy.int32(a.chunk)),
                        shared_mem=4 * a.chunk)

    def timed(kind, dirs, sms):
        """µs per copy (the slowest GPU), `dirs` = [(from, to), ...] running at once."""
        out = []
        for rep in range(a.reps + 1):
            ev = {}
            for d, to in dirs:
                with torch.cuda.device(d):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record(streams[d])
                ev[d] = (e0, e1)
            for _ in range(a.iters):
                for d, to in dirs:
                    launch(kind, d, to, sms)
            for d, _ in dirs:
                with torch.cuda.device(d):
                    ev[d][1].record(streams[d])
            for d in (0, 1):
                torch.cuda.synchronize(d)
            if rep:  # the first is the warm-up
                out.append(max(ev[d][0].elapsed_time(ev[d][1]) for d, _ in dirs) * 1e3 / a.iters)
        return statistics.median(out)

    # correctness of each kernel once (a copy that is fast and wrong measures nothing)
    for kind in ("st", "tma", "rows"):
        dst[1].zero_()
        launch(kind, 0, 1, 24)
        torch.cuda.synchronize(0)
        m = nrows * row_bytes // 2 if kind == "rows" else n // 2
        assert torch.equal(dst[1][:m].cpu(), src[0][:m].cpu()), f"{kind} copy is wrong"

    sms = [int(x) for x in a.sms.split(",")]
    print(f"bytes per GPU: {n / 1e6:.1f} MB; GB/s = bytes one GPU sends / µs (slowest GPU), median of {a.reps}\n")
    print("| kernel | SMs | one way µs | one way GB/s | both ways µs | both ways GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    cases = [("ce", 0)] + [(k, m) for k in ("st", "tma") for m in sms] + [("local", m) for m in sms]
    cases += [(k, m) for k in ("rows", "rows+local", "rows+local+ids") for m in sms if m <= 32]
    for kind, m in cases:
        if kind == "local":
            t1 = timed(kind, [(0, 0)], m)
            print(f"| local (HBM, read+write {2 * n / 1e6:.0f} MB) | {m} | {t1:.1f} | {2 * n / t1 / 1e3:.0f} | | |")
            continue
        t1 = timed(kind, [(0, 1)], m)
        t2 = timed(kind, [(0, 1), (1, 0)], m)
        print(f"| {kind} | {m or 'copy engine'} | {t1:.1f} | {n / t1 / 1e3:.0f} | {t2:.1f} | {n / t2 / 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
