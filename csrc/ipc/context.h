// What every kernel gets: its peers' regions, the region layout, the mapped host block, and the
// call it belongs to. Plain C++ (no torch, no CUDA-only syntax).
#pragma once

#include "common/protocol.h"
#include "ipc/region_layout.h"

namespace mep {

struct Peers {
  char* base[kMaxRanks];  // every rank's region, mapped here (own region included)
};

struct Ctx {
  Peers peers;
  RegionLayout lay;
  HostInfo* host;  // device view of the mapped host block
  int rank;
  int num_ranks;
  unsigned long long timeout_ns;
  long long seq;  // the call this launch belongs to (its record is control->call[seq & 1])
};

// The record a rank publishes at its call exchange (passed by value to the first kernel).
struct CallArgs {
  long long sig[kSigFields];
  int status;  // CallStatus
  int msg_len;
  char msg[kMsgBytes];
};

}  // namespace mep
