// What both NVSHMEM paths (internode, low-latency) share on host and device: the alignment of
// their symmetric-buffer sections and the error record their kernels fill in mapped host memory.
// Plain C++, no NVSHMEM, no torch.
#pragma once

#if defined(__CUDACC__)
#define MEP_HD __host__ __device__
#else
#define MEP_HD
#endif

namespace mep {

constexpr long long kSymAlign = 256;  // every section of a symmetric buffer starts on this boundary
constexpr MEP_HD long long sym_align(long long n, long long a = kSymAlign) { return (n + a - 1) / a * a; }

// What the kernels report through mapped host memory. A kernel claims the record on the device
// (its path state's err_claims == cleared: the host read the previous one; no atomics on host
// memory, which PCIe hosts may not support), fills it and publishes `code` last; the host reads
// it, then clears `code` and bumps `cleared`.
struct SymmetricError {
  volatile int code;      // ErrorCode (protocol.h): kErrTimeout or kErrMismatch; 0 = none
  volatile int op;        // Op
  volatile int what;      // the path's wait kind (LLWhat, InternodeWhat)
  volatile int expert;    // local (dispatch) or global (combine) expert id, -1 if none
  volatile int peer;      // rank waited on / that sent the mismatching signature
  volatile int set;       // buffer set
  volatile long long sig_expected;  // this rank's call signature hash
  volatile long long sig_got;       // the peer's (mismatch) or the value observed (timeout)
  volatile int cleared;             // host: records read and cleared so far
};

}  // namespace mep
