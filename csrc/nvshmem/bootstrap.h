// NVSHMEM set-up shared by every NVSHMEM path (csrc/nvshmem/bootstrap.cu). No NVSHMEM headers
// here: the torch binding includes this file with g++, which cannot parse NVSHMEM's.
#pragma once

#include <cstddef>
#include <string>

namespace mep {

std::string sym_unique_id();                                     // rank 0 creates it, the group broadcasts it
void sym_init(const std::string& uid, int rank, int nranks, int device);  // collective, unique-id bootstrap
int sym_my_pe();
int sym_n_pes();
void* sym_malloc(size_t bytes);      // collective; zeroed, and every PE is past the zeroing on return
void sym_free(void* ptr);            // collective
void* sym_peer_ptr(void* sym, int pe);  // nvshmem_ptr: a load/store address on `pe`, or null (no P2P)

}  // namespace mep
