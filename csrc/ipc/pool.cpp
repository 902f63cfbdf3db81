#include "ipc/pool.h"

namespace mep {

namespace {
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int dev) {
    cudaGetDevice(&prev);
    if (prev != dev) cudaSetDevice(dev);
  }
  ~DeviceGuard() {
    int cur = -1;
    cudaGetDevice(&cur);
    if (prev >= 0 && cur != prev) cudaSetDevice(prev);
  }
};
}  // namespace

Pool::Pool(int device, long long begin, long long bytes) : device_(device) {
  if (bytes >= kAlign) free_[begin] = bytes / kAlign * kAlign;
}

Pool::~Pool() {
  DeviceGuard g(device_);
  for (auto& p : pending_) {
    cudaEventDestroy(p.ev);
    if (p.ev2 != nullptr) cudaEventDestroy(p.ev2);
  }
  for (auto e : spare_events_) cudaEventDestroy(e);
}

long long Pool::alloc(long long bytes, cudaStream_t order) {
  bytes = block_bytes(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard g(device_);
  reap();
  long long off = take(bytes);
  bool stream_wait = false;
  while (off < 0 && !pending_.empty()) {  // memory pressure: take over the oldest frees
    // `order` waits for the range's last use on the GPU; the wait binds the event's current
    // record, so the event may be recorded again later
    cudaStreamWaitEvent(order, pending_.front().ev, 0);
    if (pending_.front().ev2 != nullptr) cudaStreamWaitEvent(order, pending_.front().ev2, 0);
    free_oldest();
    stream_wait = true;
    off = take(bytes);
  }
  stats_.stream_waits += stream_wait;
  stats_.misses += off < 0;
  return off;
}
Pool::Stats Pool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

cudaEvent_t Pool::event() {
  cudaEvent_t ev = nullptr;
  if (!spare_events_.empty()) {
    ev = spare_events_.back();
    spare_events_.pop_back();
  } else if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    ev = nullptr;
  }
  return ev;
}

void Pool::release(long long offset, long long bytes, cudaStream_t stream, const cudaStream_t* also) {
  bytes = block_bytes(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard g(device_);
  const bool two = also != nullptr && *also != stream;
  cudaEvent_t ev = event();
  cudaEvent_t ev2 = two && ev != nullptr ? event() : nullptr;
  if (ev == nullptr || (two && ev2 == nullptr)) {
    if (ev != nullptr) spare_events_.push_back(ev);
    cudaDeviceSynchronize();  // no event: make the range safe the slow way
    insert_free(offset, bytes);
    return;
  }
  cudaEventRecord(ev, stream);
  if (two) cudaEventRecord(ev2, *also);
  pending_.push_back({offset, bytes, ev, ev2});
}

bool Pool::done(const Pending& p) {
  return cudaEventQuery(p.ev) == cudaSuccess && (p.ev2 == nullptr || cudaEventQuery(p.ev2) == cudaSuccess);
}

void Pool::release_now(long long offset, long long bytes) {
  bytes = block_bytes(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  insert_free(offset, bytes);
}

long long Pool::free_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  DeviceGuard g(device_);
  reap();  // ranges whose last use has completed count as free
  long long n = 0;
  for (auto& kv : free_) n += kv.second;
  return n;
}

void Pool::reap() {
  while (!pending_.empty() && done(pending_.front())) free_oldest();
  cudaGetLastError();  // cudaEventQuery's cudaErrorNotReady is not an error here
}

void Pool::free_oldest() {
  const Pending p = pending_.front();
  pending_.pop_front();
  insert_free(p.off, p.size);
  spare_events_.push_back(p.ev);
  if (p.ev2 != nullptr) spare_events_.push_back(p.ev2);
}

long long Pool::take(long long bytes) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const long long off = it->first, rest = it->second - bytes;
    free_.erase(it);
    if (rest > 0) free_[off + bytes] = rest;
    return off;
  }
  return -1;
}

void Pool::insert_free(long long off, long long size) {
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += size;
      return;
    }
  }
  free_[off] = size;
}

}  // namespace mep
