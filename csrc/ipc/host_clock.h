// Host time of each one-crossing entry's steps (calls.h), for the host bench
// (scripts/bench host --phases): where a crossing's time goes, which the Python profiler sees
// only as one built-in call. Off unless switched on: one predictable branch per step.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <chrono>

namespace mep {

enum HostEntry : int { kEntryNotify, kEntryDispatch, kEntryCombine, kNumHostEntries };
enum HostStep : int { kStepStreams, kStepOutputs, kStepHook, kStepLaunch, kStepCounts, kStepWait, kStepLeave,
                      kStepReturn, kNumHostSteps };
constexpr const char* kHostEntryNames[kNumHostEntries] = {"notify_call", "dispatch_call", "combine_call"};
constexpr const char* kHostStepNames[kNumHostSteps] = {"streams", "outputs", "hook", "launch", "counts",
                                                         "wait", "leave", "return"};

struct HostClock {
  bool on = false;
  std::array<std::array<double, kNumHostSteps>, kNumHostEntries> ns{};
  std::array<long long, kNumHostEntries> calls{};

  // {entry: {"calls": n, step: ns in all}} since the last reset
  pybind11::dict read(bool reset) {
    pybind11::dict out;
    for (int e = 0; e < kNumHostEntries; ++e) {
      if (calls[e] == 0) continue;
      pybind11::dict d;
      d["calls"] = calls[e];
      for (int s = 0; s < kNumHostSteps; ++s)
        if (ns[e][s] > 0) d[kHostStepNames[s]] = ns[e][s];
      out[kHostEntryNames[e]] = d;
    }
    if (reset) ns = {}, calls = {};
    return out;
  }
};

// One crossing's laps: lap(step) charges the time since the last lap (or the entry) to `step`.
class StepTimer {
 public:
  StepTimer(HostClock& c, HostEntry e) : c_(c), e_(e), on_(c.on) {
    if (on_) t_ = std::chrono::steady_clock::now(), c_.calls[e_] += 1;
  }
  void lap(HostStep s) {
    if (!on_) return;
    const auto t = std::chrono::steady_clock::now();
    c_.ns[e_][s] += std::chrono::duration<double, std::nano>(t - t_).count();
    t_ = t;
  }

 private:
  HostClock& c_;
  HostEntry e_;
  bool on_;
  std::chrono::steady_clock::time_point t_;
};

}  // namespace mep
