// The intranode path's torch binding (module megatron_ep._C): the IPC runtime (ipc/runtime.h)
// and the intranode launchers, bound with named arguments in the submodule `_C.intranode`. It
// checks what the kernels assume (device, dtype, contiguity, sizes) with TORCH_CHECK, builds the
// kernel arguments and launches on the current stream (the caller makes that the buffer's
// communication stream). The only translation unit of _C that sees torch.

#include "intranode/api.h"
#include "intranode/calls.h"
#include "intranode/composed.h"
#include "ipc/runtime.h"

namespace mep {
namespace {

// ------------------------------------------------------------------------------ intranode path

void notify(Runtime& rt, const Sig& sig, const Tensor& topk_idx, int E, int align, bool permute, int worst,
            Tensor& rank_pos, Tensor& slot_pos, Tensor& recv_info, Tensor& row_limits, Tensor& tpe, Tensor& dropped,
            long long tag, int groups, bool check, const c10::optional<Tensor>& rank_counts,
            const c10::optional<Tensor>& rank_prefix, const Tensor* topk_copy) {
  // the outputs are notify_call's own (sized and typed there); the routing is the caller's, or the
  // handle's copy of it (`topk_copy`: where the kernel writes that copy as it reads the caller's)
  check_tensor(topk_idx, "topk_idx", at::kLong);
  const int T = (int)topk_idx.size(0), K = (int)topk_idx.size(1), R = rt.num_ranks();
  TORCH_CHECK(K >= 1 && K <= kMaxTopk, "megatron_ep: topk ", K, " outside 1..", kMaxTopk);
  TORCH_CHECK(E >= R && E <= kMaxExperts && E % R == 0, "megatron_ep: bad num_experts ", E);
  TORCH_CHECK(align >= 1 && align <= kMaxAlignment, "megatron_ep: bad expert alignment ", align);
  TORCH_CHECK(groups >= 1 && groups <= kMaxTokenGroups && T % groups == 0 && (long long)groups * E <= kMaxExperts,
              "megatron_ep: ", groups, " token groups do not fit ", T, " tokens and ", E, " experts");
  TORCH_CHECK(notify_scratch_rows(notify_plan(T, groups)) <= kScratchRows, "notify plan exceeds the scratch");
  const CallArgs call = make_call(sig, kCallOk, "");
  NotifyArgs a{static_cast<const long long*>(topk_idx.data_ptr()), T, K, E, align, permute ? 1 : 0, worst, groups,
               check ? 1 : 0,
               rank_pos.data_ptr<int>(), slot_pos.data_ptr<int>(), recv_info.data_ptr<int>(), row_limits.data_ptr<int>(),
               reinterpret_cast<long long*>(tpe.data_ptr<int64_t>()), reinterpret_cast<long long*>(dropped.data_ptr<int64_t>()),
               tag, ptr_or_null<int>(rank_counts), ptr_or_null<int>(rank_prefix),
               topk_copy != nullptr ? static_cast<long long*>(topk_copy->data_ptr()) : nullptr};
  launch_notify(rt.ctx(call.sig[kSigSeq]), call, a, stream());
  check_launch("notify");
}

StageArgs stage_args(const Runtime& rt, const c10::optional<Tensor>& x, int T, int row_bytes,
                     const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
                     const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos) {
  const RegionLayout& l = rt.lay();
  TORCH_CHECK(T <= l.max_tokens, "megatron_ep: ", T, " tokens exceed the region's ", l.max_tokens);
  TORCH_CHECK(row_bytes <= l.x_row_bytes && row_bytes % 16 == 0, "megatron_ep: bad dispatch row size ", row_bytes);
  TORCH_CHECK(scale_cols <= l.scale_cols, "megatron_ep: too many scale columns");
  const int K = (int)topk_idx.size(1);
  TORCH_CHECK(K <= l.max_topk, "megatron_ep: topk exceeds the region's");
  return StageArgs{x.has_value() ? x->data_ptr() : nullptr, T, row_bytes, ptr_or_null<const float>(scales), scale_cols,
                   static_cast<const long long*>(topk_idx.data_ptr()), ptr_or_null<const float>(topk_w), K,
                   rank_pos.data_ptr<int>(), slot_pos.data_ptr<int>()};
}

void stage(Runtime& rt, const Sig& sig, int slot, const c10::optional<Tensor>& x, int T, int row_bytes,
           const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
           const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos, int num_blocks) {
  const CallArgs call = make_call(sig, kCallOk, "");
  const StageArgs a = stage_args(rt, x, T, row_bytes, scales, scale_cols, topk_idx, topk_w, rank_pos, slot_pos);
  launch_stage(rt.ctx(call.sig[kSigSeq]), call, slot, a, num_blocks, stream());
  check_launch("stage");
}

DispatchArgs dispatch_args(int row_bytes, int scale_cols, int K, int E, bool permute, bool has_weights, int out_rows,
                           const Tensor& recv_info, Tensor& out_x, const c10::optional<Tensor>& out_scales,
                           const c10::optional<Tensor>& out_idx, const c10::optional<Tensor>& out_w,
                           const c10::optional<Tensor>& out_row_expert, const c10::optional<Tensor>& out_tpe,
                           const c10::optional<Tensor>& comb_map) {
  TORCH_CHECK(out_x.is_contiguous() && out_x.nbytes() >= (size_t)out_rows * row_bytes, "out_x too small");
  TORCH_CHECK(permute ? out_row_expert.has_value() : out_idx.has_value(), "missing index output");
  if (comb_map.has_value()) {
    check_tensor(*comb_map, "comb_map", at::kInt);
    TORCH_CHECK(permute && comb_map->dim() == 2 && comb_map->size(1) == K, "comb_map must be [rows, K] (expert-major)");
  }
  return DispatchArgs{row_bytes, scale_cols, K, E, permute ? 1 : 0, has_weights ? 1 : 0, out_rows,
                      recv_info.data_ptr<int>(), static_cast<char*>(out_x.data_ptr()), ptr_or_null<float>(out_scales),
                      ptr_or_null<long long>(out_idx), ptr_or_null<float>(out_w), ptr_or_null<int>(out_row_expert),
                      ptr_or_null<long long>(out_tpe), ptr_or_null<int>(comb_map)};
}

void dispatch(Runtime& rt, const Sig& sig, int slot, int row_bytes, int scale_cols, int K, int E, bool permute,
              bool has_weights, int out_rows, const Tensor& recv_info, Tensor& out_x,
              const c10::optional<Tensor>& out_scales, const c10::optional<Tensor>& out_idx,
              const c10::optional<Tensor>& out_w, const c10::optional<Tensor>& out_row_expert,
              const c10::optional<Tensor>& out_tpe, const c10::optional<Tensor>& comb_map, const CountsCopy& counts,
              const c10::optional<Tensor>& out_src, int num_blocks) {
  DispatchArgs a = dispatch_args(row_bytes, scale_cols, K, E, permute, has_weights, out_rows, recv_info, out_x,
                                 out_scales, out_idx, out_w, out_row_expert, out_tpe, comb_map);
  a.counts = counts;
  a.out_src = ptr_or_null<int>(out_src);
  launch_dispatch(rt.ctx(sig.at(kSigSeq)), slot, a, num_blocks, stream());
  check_launch("dispatch");
}

IntranodeDispatch push_launch(Runtime& rt, const Sig& sig, int slot, const Tensor& x, int T, int row_bytes,
                           const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
                           const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos, int E,
                           int out_rows, bool permute, const Tensor& recv_info, Tensor& out_x,
                           const c10::optional<Tensor>& out_scales, const c10::optional<Tensor>& out_idx,
                           const c10::optional<Tensor>& out_w, const c10::optional<Tensor>& out_row_expert,
                           const c10::optional<Tensor>& comb_map, const std::vector<long long>& offsets,
                           const CountsCopy& counts, const c10::optional<Tensor>& out_src) {
  TORCH_CHECK(offsets.size() == 5, "offsets: x, scales, idx, w, src");
  IntranodeDispatch d{};
  d.call = make_call(sig, kCallOk, "");
  d.ctx = rt.ctx(d.call.sig[kSigSeq]);
  d.slot = slot;
  PushArgs& a = d.push;
  a.in = stage_args(rt, x, T, row_bytes, scales, scale_cols, topk_idx, topk_w, rank_pos, slot_pos);
  const int K = a.in.K;
  a.out = dispatch_args(row_bytes, scale_cols, K, E, permute, topk_w.has_value(), out_rows, recv_info, out_x, out_scales,
                        out_idx, out_w, out_row_expert, c10::nullopt, comb_map);
  a.out.counts = counts;
  a.out.out_src = ptr_or_null<int>(out_src);  // (where the push falls back to stage + pull)
  a.out_x_off = offsets[0];
  a.out_s_off = offsets[1];
  a.out_idx_off = offsets[2];
  a.out_w_off = offsets[3];
  a.out_src_off = offsets[4];
  return d;
}

void dispatch_push(Runtime& rt, const Sig& sig, int slot, const Tensor& x, int T, int row_bytes,
                   const c10::optional<Tensor>& scales, int scale_cols, const Tensor& topk_idx,
                   const c10::optional<Tensor>& topk_w, const Tensor& rank_pos, const Tensor& slot_pos, int E,
                   int out_rows, bool permute, const Tensor& recv_info, Tensor& out_x,
                   const c10::optional<Tensor>& out_scales, const c10::optional<Tensor>& out_idx,
                   const c10::optional<Tensor>& out_w, const c10::optional<Tensor>& out_row_expert,
                   const c10::optional<Tensor>& comb_map, std::vector<long long> offsets, const CountsCopy& counts,
                   const c10::optional<Tensor>& out_src, int num_blocks) {
  const IntranodeDispatch d = push_launch(rt, sig, slot, x, T, row_bytes, scales, scale_cols, topk_idx, topk_w,
                                          rank_pos, slot_pos, E, out_rows, permute, recv_info, out_x, out_scales, out_idx,
                                          out_w, out_row_expert, comb_map, offsets, counts, out_src);
  launch_dispatch_push(d.ctx, d.call, d.slot, d.push, num_blocks, stream());
  check_launch("dispatch_push");
}

// The pooled rank-major rows of an expert-major push (pool_rank_major's tensors; its int64 index
// columns hold (expert-major row, local expert) int32 pairs) into the expert-major outputs.
void fanout(Runtime& rt, const Sig& sig, const Tensor& rows, const c10::optional<Tensor>& scales, const Tensor& map,
            const c10::optional<Tensor>& w, int row_bytes, int scale_cols, int K, int E, bool has_weights, int out_rows,
            const Tensor& recv_info, Tensor& out_x, const c10::optional<Tensor>& out_scales,
            const c10::optional<Tensor>& out_w, const Tensor& out_row_expert, const Tensor& comb_map,
            const c10::optional<Tensor>& src, const c10::optional<Tensor>& out_src, int num_blocks) {
  TORCH_CHECK(map.scalar_type() == at::kLong && map.dim() == 2 && map.size(1) == K, "fanout: bad map");
  TORCH_CHECK(src.has_value() == out_src.has_value(), "fanout: the pooled source tokens and their output go together");
  FanoutArgs a;
  a.out = dispatch_args(row_bytes, scale_cols, K, E, true, has_weights, out_rows, recv_info, out_x, out_scales,
                        c10::nullopt, out_w, out_row_expert, c10::nullopt, comb_map);
  a.rows = static_cast<const char*>(rows.data_ptr());
  a.scales = ptr_or_null<const float>(scales);
  a.map = static_cast<const int*>(map.data_ptr());
  a.w = ptr_or_null<const float>(w);
  a.src = ptr_or_null<const int>(src);
  a.out.out_src = ptr_or_null<int>(out_src);
  launch_fanout(rt.ctx(sig.at(kSigSeq)), a, num_blocks, stream());
  check_launch("fanout");
}

// Expert-major combine, first half: the local pre-reduction into partials of x's dtype (replaces the staging).
CombineReduceArgs combine_reduce_args(Runtime& rt, const Tensor& x, int rows, int H, bool is_fp32, const Tensor& comb_map,
                                      const Tensor& recv_info, const c10::optional<Tensor>& w) {
  const RegionLayout& l = rt.lay();
  check_tensor(comb_map, "comb_map", at::kInt);
  TORCH_CHECK(x.is_contiguous() && x.size(0) == rows && x.size(1) == H, "combine_reduce: bad x");
  TORCH_CHECK(H % 4 == 0, "combine_reduce: hidden must be a multiple of 4");
  TORCH_CHECK(rows <= l.comb_rows, "megatron_ep: combine input has ", rows, " rows; the region holds ", l.comb_rows);
  TORCH_CHECK(comb_map.size(0) * H * x.element_size() <= (int64_t)l.comb_rows * l.comb_row_bytes,
              "combine_reduce: the partials exceed the combine area");
  return CombineReduceArgs{x.data_ptr(), rows, H, is_fp32 ? 1 : 0, comb_map.data_ptr<int>(), recv_info.data_ptr<int>(),
                           (int)comb_map.size(1), ptr_or_null<const float>(w)};
}

StageCombineArgs stage_combine_args(Runtime& rt, const c10::optional<Tensor>& x, int rows, int row_bytes,
                                    const c10::optional<Tensor>& w, int w_cols) {
  const RegionLayout& l = rt.lay();
  TORCH_CHECK(rows <= l.comb_rows, "megatron_ep: combine input has ", rows, " rows; the region holds ", l.comb_rows);
  TORCH_CHECK(row_bytes <= l.comb_row_bytes && row_bytes % 16 == 0, "megatron_ep: bad combine row size ", row_bytes);
  TORCH_CHECK(w_cols <= l.max_topk, "megatron_ep: combine weight columns exceed the region's");
  return StageCombineArgs{x.has_value() ? x->data_ptr() : nullptr, rows, row_bytes, ptr_or_null<const float>(w), w_cols};
}

// A bias the kernel starts a token's sum from: y's dtype, shape and device, contiguous (Buffer checked
// it; this guards the pointer arithmetic).
const void* bias_ptr(const c10::optional<Tensor>& b, const Tensor& y) {
  if (!b.has_value()) return nullptr;
  TORCH_CHECK(b->scalar_type() == y.scalar_type() && b->is_contiguous() && b->dim() == 2 && b->size(0) == y.size(0) &&
                  b->size(1) == y.size(1) && b->device() == y.device(),
              "megatron_ep: combine bias must be contiguous, of y's shape, dtype and device");
  return b->data_ptr();
}

CombineArgs combine_args(int T, int H, int K, int E, bool permute, bool is_fp32, bool has_weights, int variant,
                         const Tensor& row_limits, const Tensor& topk_idx, const Tensor& rank_pos, const Tensor& slot_pos,
                         Tensor& y, const c10::optional<Tensor>& w_out, const c10::optional<Tensor>& bias0,
                         const c10::optional<Tensor>& bias1) {
  check_tensor(topk_idx, "topk_idx", at::kLong);
  check_tensor(row_limits, "row_limits", at::kInt);
  TORCH_CHECK(y.is_contiguous() && y.size(0) == T && y.size(1) == H, "y has the wrong shape");
  TORCH_CHECK(variant >= kCombineStaged && variant <= kCombineSingle, "megatron_ep: unknown combine variant ", variant);
  TORCH_CHECK(variant != kCombineSingle || permute, "megatron_ep: single_reduction sums an expert-major combine");
  return CombineArgs{T, H, K, E, permute ? 1 : 0, is_fp32 ? 1 : 0, has_weights ? 1 : 0,
                     variant == kCombinePartials ? 1 : 0, variant == kCombineSingle ? 1 : 0,
                     row_limits.data_ptr<int>(), static_cast<const long long*>(topk_idx.data_ptr()),
                     rank_pos.data_ptr<int>(), slot_pos.data_ptr<int>(), y.data_ptr(), ptr_or_null<float>(w_out),
                     bias_ptr(bias0, y), bias_ptr(bias1, y)};
}

// ------------------------------------------------------------------ one crossing per call (calls.h)
HandleState handle_state(const Tensor& topk_idx, const Tensor& rank_pos, const Tensor& slot_pos, const Tensor& recv_info,
                         const Tensor& row_limits, const Tensor& counts, const c10::optional<Tensor>& comb_map, int E,
                         bool permute) {
  check_tensor(topk_idx, "topk_idx", at::kLong);
  check_tensor(rank_pos, "rank_pos", at::kInt);
  check_tensor(slot_pos, "slot_pos", at::kInt);
  check_tensor(recv_info, "recv_info", at::kInt);
  check_tensor(row_limits, "row_limits", at::kInt);
  check_tensor(counts, "counts", at::kLong);
  TORCH_CHECK(topk_idx.dim() == 2, "megatron_ep: topk_idx must be [T, K]");
  TORCH_CHECK(E >= 1 && E % (int)row_limits.numel() == 0 && counts.numel() == E / row_limits.numel() + 1,
              "megatron_ep: counts must hold tokens_per_expert and num_dropped");
  HandleState st;
  st.topk_idx = topk_idx, st.rank_pos = rank_pos, st.slot_pos = slot_pos, st.recv_info = recv_info;
  st.row_limits = row_limits, st.comb_map = comb_map;
  st.keep_counts(counts);
  st.T = (int)topk_idx.size(0), st.K = (int)topk_idx.size(1), st.E = E, st.permute = permute;
  return st;
}

// notify's half of a new routing (notify_call, dispatch_first_call), on `cs`'s streams: the counts
// every dispatch along the routing returns on the caller's, the handle's tensors on ours (one
// allocation: they die with the handle), the routing's copy, notify launched; the handle's state
// bound from what it made (binding it from Python would check each tensor again).
struct Notified {
  Tensor counts, tpe, dropped;
  c10::optional<Tensor> rank_counts, rank_prefix;  // (when asked) every rank's tokens per destination, and their prefix
  c10::optional<Tensor> recv_rank_counts, recv_rank_prefix;  // their columns of this rank (a view made here costs
                                                             // the host less than Python's indexing)
  HandleState st;
  int L = 0;
};

Notified notify_part(Runtime& rt, CallStreams& cs, StepTimer& clock, const Sig& sig, const Tensor& topk_idx, int E,
                     int align, bool permute, int worst, int groups, bool check, bool want_rank_counts, long long tag,
                     const py::object& marks, bool async_op) {
  const int R = rt.num_ranks(), T = (int)topk_idx.size(0), K = (int)topk_idx.size(1);
  TORCH_CHECK(E >= R && E % R == 0, "megatron_ep: bad num_experts ", E);
  TORCH_CHECK(topk_idx.is_cuda() && topk_idx.scalar_type() == at::kLong, "megatron_ep: topk_idx must be a CUDA int64 tensor");
  Notified n;
  n.L = E / R;
  c10::cuda::CUDAStreamGuard on_comm(cs.comm());
  mark(marks, 0);
  // (the counts the first dispatch returns, and the handle's own copy of them: the handle keeps the
  // allocation alive while the caller's views of the first do)
  std::vector<ArenaPart> parts{{at::kLong, {T, K}},        {at::kInt, {T, R}},  {at::kInt, {T, K}},
                               {at::kInt, {RecvInfo::size(n.L)}}, {at::kInt, {R}}, {at::kLong, {n.L + 1}},
                               {at::kLong, {n.L + 1}}};
  if (want_rank_counts)
    parts.insert(parts.end(), {{at::kInt, {(int64_t)groups * R, R}}, {at::kInt, {(int64_t)groups * R, R}}});
  const std::vector<Tensor> kept = arena_tensors(parts, topk_idx.options());
  HandleState& st = n.st;
  st.topk_idx = kept[0], st.rank_pos = kept[1], st.slot_pos = kept[2], st.recv_info = kept[3], st.row_limits = kept[4];
  n.counts = kept[5], st.own = kept[6];
  n.tpe = head(n.counts, n.L), n.dropped = element(n.counts, n.L);
  if (want_rank_counts) {
    n.rank_counts = kept[7], n.rank_prefix = kept[8];
    n.recv_rank_counts = column(kept[7], rt.rank()), n.recv_rank_prefix = column(kept[8], rt.rank());
  }
  // the handle's copy of the routing: notify writes it as it reads the caller's (contiguous) ids
  const bool direct = topk_idx.is_contiguous();
  if (!direct) st.topk_idx.copy_(topk_idx);
  // the caller's ids are read on our stream: an asynchronous caller may free them at once
  if (async_op) topk_idx.record_stream(cs.comm());
  clock.lap(kStepOutputs);
  notify(rt, sig, direct ? topk_idx : st.topk_idx, E, align, permute, worst, st.rank_pos, st.slot_pos, st.recv_info,
         st.row_limits, n.tpe, n.dropped, tag, groups, check, n.rank_counts, n.rank_prefix,
         direct ? &st.topk_idx : nullptr);
  rt.set_notified(tag);
  mark(marks, 1);
  clock.lap(kStepLaunch);
  st.keep_counts(n.counts);
  st.T = T, st.K = K, st.E = E, st.permute = permute;
  return n;
}

// (topk_idx copy, rank_pos, slot_pos, recv_info, row_limits, counts, tokens_per_expert, num_dropped,
// rank_counts and its prefix over the rows, and their columns of this rank, or None each, the wait's
// status, the sizes or None, the HandleState); the state moves into its Python object
// With `lean` (dispatch_first_call: the dispatch half returns the counts the caller and the handle
// keep) the handle's four index tensors and notify's counts come back None: the HandleState holds
// them (HandleState.tensors() where Python needs them), and each tensor handed to Python costs
// host time to wrap and, at the next call, to free.
py::tuple notified_tuple(Notified& n, const py::tuple& sizes, bool lean) {
  const HandleState& st = n.st;
  const auto opt = [](const c10::optional<Tensor>& x) { return x.has_value() ? py::cast(*x) : py::none(); };
  const auto unless_lean = [lean](const Tensor& x) { return lean ? py::object(py::none()) : py::cast(x); };
  // the state goes in last, once the tensors were read from it (in one make_tuple the arguments'
  // order of evaluation is unspecified)
  py::tuple t = py::make_tuple(st.topk_idx, unless_lean(st.rank_pos), unless_lean(st.slot_pos),
                               unless_lean(st.recv_info), unless_lean(st.row_limits), unless_lean(n.counts),
                               unless_lean(n.tpe), unless_lean(n.dropped), opt(n.rank_counts), opt(n.rank_prefix),
                               opt(n.recv_rank_counts), opt(n.recv_rank_prefix), sizes[0], sizes[1], py::none());
  t[14] = py::cast(std::move(n.st));
  return t;
}

// A new routing's notify in one crossing (a worst-case sized one's, and tracing's): our stream
// after the caller's (or `previous`), then notify_part (given a previous_event our stream waits
// for that event only, so the routing's copy is made on ours: one on the caller's stream, queued
// after the event, could still be unwritten when notify reads it). The caller's stream waits at the
// dispatch's end (dispatch_call). With wait_s >= 0 the host then waits for notify's sizes
// (Runtime::wait_counts, without the GIL). Returns notified_tuple's tuple: tokens_per_expert and
// num_dropped are views of counts [L + 1], so a cached dispatch copies both with one copy.
py::tuple notify_call(Runtime& rt, const Sig& sig, const Tensor& topk_idx, int E, int align, bool permute, int worst,
                      int groups, bool check, bool want_rank_counts, long long tag, const py::object& previous,
                      const py::object& marks, double wait_s, bool async_op) {
  StepTimer clock(rt.clock(), kEntryNotify);
  CallStreams cs(rt, previous, false);
  clock.lap(kStepStreams);
  Notified n = notify_part(rt, cs, clock, sig, topk_idx, E, align, permute, worst, groups, check, want_rank_counts, tag,
                           marks, async_op);
  const py::tuple sizes = wait_s >= 0 ? rt.wait_counts(tag, wait_s, n.L) : py::make_tuple(-1, py::none());
  clock.lap(kStepWait);
  py::tuple out = notified_tuple(n, sizes, false);
  clock.lap(kStepReturn);
  return out;
}

// A combine's host side: y (and the weights) on the caller's stream unless given, then stage (or
// the expert-major pre-reduction, `variant` kCombinePartials) and the pull-and-sum on ours (every
// slot's row a term of its own: kCombineSingle); with `fused` (the
// internode path's fused combine) the whole intranode combine as its launch record instead,
// fused(record, y, w_out). `bias0`, `bias1`: the sums' start (none with `fused`: the internode
// path adds its biases in the sum over nodes). Returns (y, w_out).
py::tuple combine_part(Runtime& rt, const HandleState& st, const Sig& sig, const Tensor& x,
                       const c10::optional<Tensor>& weights, const c10::optional<Tensor>& bias0,
                       const c10::optional<Tensor>& bias1, int variant, bool zero_copy,
                       const c10::optional<Tensor>& out_y, const c10::optional<Tensor>& out_w,
                       const py::object& previous, const py::object& event, bool async_op, const py::object& hook,
                       const FusedCombine* fused, const py::object& marks, int num_blocks, int local_blocks) {
  const int rows = (int)x.size(0), H = (int)x.size(1), row_bytes = H * (int)x.element_size();
  const bool is_fp32 = x.scalar_type() == at::kFloat, has_w = weights.has_value();
  const int w_cols = st.permute ? 1 : st.K;
  const bool partials = variant == kCombinePartials;
  StepTimer clock(rt.clock(), kEntryCombine);
  CallStreams cs(rt, previous, false);
  clock.lap(kStepStreams);
  Tensor y;
  c10::optional<Tensor> w_out;
  if (out_y.has_value()) {
    y = *out_y;
    w_out = out_w;
  } else {
    y = at::empty({st.T, H}, x.options());
    if (has_w) w_out = at::empty({st.T, st.K}, x.options().dtype(at::kFloat));
  }
  clock.lap(kStepOutputs);
  if (apply_hook(hook, {&y, opt_ptr(w_out)})) cs.after_caller();
  clock.lap(kStepHook);
  {
    c10::cuda::CUDAStreamGuard on_comm(cs.comm());
    mark(marks, 0);
    const c10::optional<Tensor> staged = zero_copy ? c10::nullopt : c10::optional<Tensor>(x);
    if (fused != nullptr) {
      TORCH_CHECK(!bias0.has_value() && !bias1.has_value(),
                  "megatron_ep: the intranode stage of a combine takes no bias");
      TORCH_CHECK(variant != kCombineSingle, "megatron_ep: the intranode stage of a combine sums per rank");
      IntranodeCombine d{};
      d.call = make_call(sig, kCallOk, "");
      d.ctx = rt.ctx(d.call.sig[kSigSeq]);
      d.partials = partials ? 1 : 0;
      if (partials) {
        TORCH_CHECK(st.comb_map.has_value() && !zero_copy, "megatron_ep: partials need x and comb_map");
        d.reduce = combine_reduce_args(rt, x, rows, H, is_fp32, *st.comb_map, st.recv_info, weights);
      } else {
        d.stage = stage_combine_args(rt, staged, rows, row_bytes, weights, w_cols);
      }
      d.comb = combine_args(st.T, H, st.K, st.E, st.permute, is_fp32, has_w, variant, st.row_limits, st.topk_idx,
                            st.rank_pos, st.slot_pos, y, w_out, c10::nullopt, c10::nullopt);
      (*fused)(d, y, w_out);
    } else {
      const CombineArgs comb = combine_args(st.T, H, st.K, st.E, st.permute, is_fp32, has_w, variant, st.row_limits,
                                            st.topk_idx, st.rank_pos, st.slot_pos, y, w_out, bias0, bias1);
      const CallArgs call = make_call(sig, kCallOk, "");
      const Ctx ctx = rt.ctx(call.sig[kSigSeq]);
      if (partials) {  // the pre-reduction on the local SMs, then the partials' sum
        TORCH_CHECK(st.comb_map.has_value(), "megatron_ep: partials need the dispatch's comb_map");
        launch_combine_reduce(ctx, call, combine_reduce_args(rt, x, rows, H, is_fp32, *st.comb_map, st.recv_info, weights),
                              local_blocks, stream());
        check_launch("combine_reduce");
        mark(marks, 1);
        launch_combine_partials(ctx, comb, num_blocks, stream());
      } else {
        launch_stage_and_combine(ctx, call, stage_combine_args(rt, staged, rows, row_bytes, weights, w_cols), comb,
                                 num_blocks, stream());
      }
      check_launch("combine");
    }
    mark(marks, 2);
  }
  clock.lap(kStepLaunch);
  cs.leave(event, async_op, {&x, opt_ptr(weights), &y, opt_ptr(w_out), &st.topk_idx, &st.rank_pos, &st.slot_pos,
                             &st.row_limits, opt_ptr(st.comb_map), &st.recv_info, opt_ptr(bias0), opt_ptr(bias1)});
  clock.lap(kStepLeave);
  py::tuple out = py::make_tuple(y, w_out.has_value() ? py::cast(*w_out) : py::none());
  clock.lap(kStepReturn);
  return out;
}

// A dispatch's host side after its plan (and, for a new routing, after notify: `first`, the streams
// already ordered): the outputs on the caller's stream (pooled rank-major rows when pushing: the
// outputs themselves, or the fan-out's source), the rows moved on ours (push [+ fan-out], or
// stage + pull; with `fused`, the push's launch record for the internode path's fused dispatch),
// the counts, the event. `scratch`: the expert-major push may use the combine area as its
// rank-major buffer. `comb_rows`: a new expert-major routing's combine map rows (N, or the bound
// when the host does not know N). Returns (x, scales, topk_idx, weights, row_expert,
// tokens_per_expert, num_dropped, the handle's own counts, tokens_per_expert and num_dropped (views
// of its counts), comb_map).
py::tuple dispatch_part(Runtime& rt, CallStreams& cs, StepTimer& clock, HandleState& st, const Sig& sig, bool first,
                        const Tensor& data, const c10::optional<Tensor>& scales, const c10::optional<Tensor>& topk_w,
                        bool push, bool scratch, bool zero_copy, int out_rows, int worst, int comb_rows,
                        const py::object& event, bool async_op, const py::object& hook, const FusedDispatch* fused,
                        const py::object& marks, int num_blocks, int push_blocks, int local_blocks, bool want_src) {
  const int T = st.T, K = st.K, E = st.E, H = (int)data.size(1);
  TORCH_CHECK(!want_src || fused == nullptr, "megatron_ep: a fused intranode dispatch writes no source tokens");
  const int row_bytes = H * (int)data.element_size(), scale_cols = scales.has_value() ? (int)scales->size(1) : 0;
  const bool permute = st.permute, has_w = topk_w.has_value();
  const auto dev = data.options();
  const cudaStream_t compute = cs.compute().stream(), comm = cs.comm().stream();
  if (first && permute && !st.comb_map.has_value()) {  // our stream's, like every tensor the handle keeps
    c10::cuda::CUDAStreamGuard on_comm(cs.comm());
    st.comb_map = at::empty({comb_rows, K}, dev.dtype(at::kInt));
  }
  // the counts the caller gets: a new routing's notify wrote the handle's; a cached dispatch
  // returns copies of them (the caller's outputs are its own), made by the kernel that moves the rows
  const int L = E / rt.num_ranks();
  const Tensor counts = first ? st.counts : at::empty({L + 1}, dev.dtype(at::kLong));
  const Tensor tpe = head(counts, L), dropped = element(counts, L);
  // ... and a new routing's handle keeps its own copy of notify's, made by that kernel too unless the
  // rows it moves are still being counted (rank-major, worst-case sized: the pull counts them)
  const bool count_rows = first && worst > 0 && !permute;
  Tensor own;
  if (first) own = st.own.defined() ? st.own : at::empty({L + 1}, dev.dtype(at::kLong));
  const Tensor& copy_to = first ? own : counts;
  const CountsCopy copy = count_rows ? CountsCopy{}
                                     : CountsCopy{static_cast<const long long*>((first ? counts : st.counts).data_ptr()),
                                                  static_cast<long long*>(copy_to.data_ptr()), L + 1};
  // outputs
  RankMajor pooled;
  bool have_pool = false;
  if (push && permute) {  // a rank-major buffer for the fan-out (N rows, or the bound)
    TORCH_CHECK(st.comb_map.has_value(), "megatron_ep: an expert-major dispatch needs comb_map");
    const int rows = std::max<int>(1, (int)st.comb_map->size(0));
    const RegionLayout& l = rt.lay();
    have_pool = (scratch && rt.block_at(l.comb_x, l.comb_w, rows, H, data.scalar_type(), row_bytes, scale_cols, K, has_w,
                                        want_src, pooled)) ||
                rt.pool_block(rows, H, data.scalar_type(), row_bytes, scale_cols, K, has_w, want_src, compute, true, comm,
                              pooled);
  } else if (push) {
    // the block's first writer waits for its last use: the push kernel (our stream; the peers
    // wait for its start), or an output hook (the caller's) before it
    have_pool = rt.pool_block(out_rows, H, data.scalar_type(), row_bytes, scale_cols, K, has_w, want_src, compute,
                              false, hook.is_none() ? comm : compute, pooled);
  }
  Tensor x;
  c10::optional<Tensor> out_s, out_idx, out_w, row_expert;
  if (have_pool && !permute) {
    x = pooled.x, out_s = pooled.scales, out_idx = pooled.idx, out_w = pooled.w;
  } else {
    x = at::empty({out_rows, H}, dev);
    if (scales.has_value()) out_s = at::empty({out_rows, scale_cols}, dev.dtype(at::kFloat));
    if (!permute) out_idx = at::empty({out_rows, K}, dev.dtype(at::kLong));
    if (has_w) out_w = permute ? at::empty({out_rows}, dev.dtype(at::kFloat)) : at::empty({out_rows, K}, dev.dtype(at::kFloat));
  }
  if (permute) row_expert = at::empty({out_rows}, dev.dtype(at::kInt));
  // DeepEP V2's recv_src_metadata: each rank-major row's source token, -1 where no row arrived,
  // in a tensor of its own on our stream (the handle keeps it, as it keeps its other tensors made
  // there; a view into the pooled block would pin the block, rows and all, while the handle
  // lives). Rank-major pooled rows are all real (N of them): the kernels write the block's
  // section (the push, or the pull it falls back to) and it is copied out after them. Elsewhere
  // the kernels write the tensor (the pull, the fan-out), filled with -1 first.
  c10::optional<Tensor> out_src, src_in_block;
  if (want_src) {
    c10::cuda::CUDAStreamGuard on_comm(cs.comm());
    if (have_pool && !permute) {
      src_in_block = pooled.src;
      out_src = at::empty({(int64_t)out_rows}, dev.dtype(at::kInt));
    } else {
      out_src = at::full({permute ? st.comb_map->size(0) : (int64_t)out_rows}, -1, dev.dtype(at::kInt));
    }
  }
  clock.lap(kStepOutputs);
  if (apply_hook(hook, {&x, opt_ptr(out_s), opt_ptr(out_idx), opt_ptr(out_w), opt_ptr(row_expert)})) cs.after_caller();
  clock.lap(kStepHook);
  const std::vector<long long> offsets = have_pool ? pooled.offsets : std::vector<long long>{-1, -1, -1, -1, -1};
  {
    c10::cuda::CUDAStreamGuard on_comm(cs.comm());
    const int slot = !first ? kSlotCall : (push ? kSlotOutLoc : kSlotStaged);
    if (fused != nullptr || push) {
      if (fused != nullptr) {
        // where the outputs are not pooled (no push) the fused kernel stages and pulls (offsets -1)
        (*fused)(push_launch(rt, sig, slot, data, T, row_bytes, scales, scale_cols, st.topk_idx, topk_w, st.rank_pos,
                             st.slot_pos, E, out_rows, permute, st.recv_info, x, out_s, out_idx, out_w, row_expert,
                             st.comb_map, offsets, copy, c10::nullopt));
      } else {
        dispatch_push(rt, sig, slot, data, T, row_bytes, scales, scale_cols, st.topk_idx, topk_w, st.rank_pos,
                      st.slot_pos, E, out_rows, permute, st.recv_info, x, out_s, out_idx, out_w, row_expert,
                      st.comb_map, offsets, copy, src_in_block.has_value() ? src_in_block : out_src, push_blocks);
      }
      mark(marks, 0);
      if (permute) {
        if (have_pool)
          fanout(rt, sig, pooled.x, pooled.scales, pooled.idx, pooled.w, row_bytes, scale_cols, K, E, has_w, out_rows,
                 st.recv_info, x, out_s, out_w, *row_expert, *st.comb_map, pooled.src, out_src, local_blocks);
        mark(marks, 1);
      }
    } else {
      stage(rt, sig, slot, zero_copy ? c10::nullopt : c10::optional<Tensor>(data), T, row_bytes, scales, scale_cols,
            st.topk_idx, topk_w, st.rank_pos, st.slot_pos, num_blocks);
      mark(marks, 0);
      // rank-major, worst-case sized: the pull counts the rows it delivers (notify zeroed tpe)
      dispatch(rt, sig, slot, row_bytes, scale_cols, K, E, permute, has_w, out_rows, st.recv_info, x, out_s, out_idx,
               out_w, row_expert, count_rows ? c10::optional<Tensor>(tpe) : c10::nullopt, st.comb_map, copy, out_src,
               num_blocks);
      mark(marks, 1);
    }
    if (src_in_block.has_value())  // every peer's push into the block completed within the push kernel
      C10_CUDA_CHECK(cudaMemcpyAsync(out_src->data_ptr(), src_in_block->data_ptr(), out_src->nbytes(),
                                     cudaMemcpyDeviceToDevice, comm));
    clock.lap(kStepLaunch);
    if (count_rows)  // after the rows moved (a raw copy: ATen's copy_ costs more host time than the copy)
      C10_CUDA_CHECK(cudaMemcpyAsync(own.data_ptr(), counts.data_ptr(), counts.nbytes(), cudaMemcpyDeviceToDevice, comm));
    if (first) {
      st.keep_counts(own);
      st.own = Tensor();
    }
    clock.lap(kStepCounts);
  }
  cs.leave(event, async_op, {&data, opt_ptr(scales), &st.topk_idx, opt_ptr(topk_w), &st.rank_pos, &st.slot_pos,
                             &st.recv_info, &st.row_limits, opt_ptr(st.comb_map), &x, opt_ptr(out_s), opt_ptr(out_idx),
                             opt_ptr(out_w), opt_ptr(row_expert), &counts, opt_ptr(out_src)});
  clock.lap(kStepLeave);
  const auto opt = [](const c10::optional<Tensor>& t) { return t.has_value() ? py::cast(*t) : py::none(); };
  py::tuple out = py::make_tuple(x, opt(out_s), opt(out_idx), opt(out_w), opt(row_expert), tpe, dropped, st.counts,
                                 st.tokens_per_expert, st.num_dropped, opt(st.comb_map), opt(out_src));
  clock.lap(kStepReturn);
  return out;
}

py::tuple dispatch_entry(Runtime& rt, HandleState& st, const Sig& sig, bool first, const Tensor& data,
                         const c10::optional<Tensor>& scales, const c10::optional<Tensor>& topk_w, bool push,
                         bool scratch, bool zero_copy, int out_rows, int worst, int comb_rows,
                         const py::object& previous, const py::object& event, bool async_op, const py::object& hook,
                         const py::object& marks, int num_blocks, int push_blocks, int local_blocks, bool want_src,
                         const FusedDispatch* fused) {
  StepTimer clock(rt.clock(), kEntryDispatch);
  CallStreams cs(rt, previous, first);
  clock.lap(kStepStreams);
  return dispatch_part(rt, cs, clock, st, sig, first, data, scales, topk_w, push, scratch, zero_copy, out_rows, worst,
                       comb_rows, event, async_op, hook, fused, marks, num_blocks, push_blocks, local_blocks, want_src);
}

py::tuple dispatch_call(Runtime& rt, HandleState& st, const Sig& sig, bool first, const Tensor& data,
                        const c10::optional<Tensor>& scales, const c10::optional<Tensor>& topk_w, bool push,
                        bool scratch, bool zero_copy, int out_rows, int worst, int comb_rows, const py::object& previous,
                        const py::object& event, bool async_op, const py::object& hook, const py::object& marks,
                        int num_blocks, int push_blocks, int local_blocks, bool want_src) {
  return dispatch_entry(rt, st, sig, first, data, scales, topk_w, push, scratch, zero_copy, out_rows, worst, comb_rows,
                        previous, event, async_op, hook, marks, num_blocks, push_blocks, local_blocks, want_src, nullptr);
}

py::tuple combine_call(Runtime& rt, const HandleState& st, const Sig& sig, const Tensor& x,
                       const c10::optional<Tensor>& weights, const c10::optional<Tensor>& bias0,
                       const c10::optional<Tensor>& bias1, int variant, bool zero_copy,
                       const c10::optional<Tensor>& out_y, const c10::optional<Tensor>& out_w,
                       const py::object& previous, const py::object& event, bool async_op, const py::object& hook,
                       const py::object& marks, int num_blocks, int local_blocks) {
  return combine_part(rt, st, sig, x, weights, bias0, bias1, variant, zero_copy, out_y, out_w, previous, event, async_op,
                      hook, nullptr, marks, num_blocks, local_blocks);
}

// A new routing's whole dispatch in one crossing (not worst-case sized): notify, the host wait for
// its sizes, then -- where they came, the call was not aborted and every rank's rows fit the
// region as it is (`fits`: the needs other than the counts fit, which the caller checked) -- the
// rest as dispatch_call does it. Returns (status, notify_call's tuple, dispatch_call's tuple or
// None): status 0 dispatched; 1 stopped after the wait (the caller reads the sizes, grows the
// region or raises, then calls dispatch_call). An exception out of it after notify was launched
// leaves Runtime::notified_tag at `tag` (the caller publishes its failure where the peers then
// wait). The steps are charged to notify_call's and dispatch_call's host clocks.
py::tuple dispatch_first_call(Runtime& rt, const Sig& sig, const Tensor& topk_idx, int E, int align, bool permute,
                              int groups, bool check, bool want_rank_counts, long long tag, const py::object& previous,
                              const py::object& notify_marks, double wait_s, bool fits, const Tensor& data,
                              const c10::optional<Tensor>& scales, const c10::optional<Tensor>& topk_w, bool push,
                              bool scratch, bool zero_copy, const py::object& event, bool async_op,
                              const py::object& hook, const py::object& marks, int num_blocks, int push_blocks,
                              int local_blocks, bool want_src) {
  StepTimer clock(rt.clock(), kEntryNotify);
  CallStreams cs(rt, previous, false);
  clock.lap(kStepStreams);
  Notified n = notify_part(rt, cs, clock, sig, topk_idx, E, align, permute, 0, groups, check, want_rank_counts, tag,
                           notify_marks, async_op);
  const py::tuple sizes = rt.wait_counts(tag, wait_s, n.L);
  clock.lap(kStepWait);
  int rows = 0, perm_rows = 0;
  bool go = fits && sizes[0].cast<int>() == 0;
  if (go) {
    const py::dict info = sizes[1];
    rows = info["num_rows"].cast<int>(), perm_rows = info["num_perm_rows"].cast<int>();
    const RegionLayout& l = rt.lay();
    // (megatron_ep/backends/cuda/runtime.py fits()'s count rule: the group's largest needs, the same on every rank)
    go = rows >= 0 && info["need_tokens"].cast<long long>() <= l.max_tokens &&
         info[permute ? "need_perm_rows" : "need_rows"].cast<long long>() <= l.comb_rows;
  }
  if (!go) return py::make_tuple(1, notified_tuple(n, sizes, true), py::none());
  StepTimer dclock(rt.clock(), kEntryDispatch);
  py::tuple out = dispatch_part(rt, cs, dclock, n.st, sig, true, data, scales, topk_w, push, scratch, zero_copy,
                                permute ? perm_rows : rows, 0, permute ? rows : 0, event, async_op, hook, nullptr,
                                marks, num_blocks, push_blocks, local_blocks, want_src);
  return py::make_tuple(0, notified_tuple(n, sizes, true), out);
}

// get_dispatch_layout in one crossing, on the current stream: the counts in one zeroed buffer
// [R + E] (int64, or int32 with counts_int32), token_in_rank [T, R]; returns (tokens_per_rank,
// tokens_per_expert, token_in_rank).
py::tuple layout(const Tensor& topk_idx, int E, int R, bool counts_int32) {
  check_tensor(topk_idx, "topk_idx", at::kLong);
  TORCH_CHECK(topk_idx.dim() == 2, "megatron_ep: topk_idx must be [T, K]");
  TORCH_CHECK(R >= 1 && R <= 32 && E % R == 0 && E <= 16384, "megatron_ep: layout needs 1 <= R <= 32 and R | E");
  c10::cuda::CUDAGuard guard(topk_idx.device());
  const int T = (int)topk_idx.size(0);
  // the counts and token_in_rank in one allocation (tensor_args.h arena_tensors); zeroed by the launch where needed
  const std::vector<Tensor> made =
      arena_tensors({{counts_int32 ? at::kInt : at::kLong, {R + E}}, {at::kBool, {T, R}}}, topk_idx.options());
  const Tensor &counts = made[0], &in_rank = made[1];
  const Tensor per_rank = head(counts, R), per_expert = alias(counts, {E}, {1}, R);
  launch_layout(static_cast<const long long*>(topk_idx.data_ptr()), T, (int)topk_idx.size(1), E, R, per_rank.data_ptr(),
                per_expert.data_ptr(), counts_int32, in_rank.data_ptr<bool>(), stream());
  check_launch("layout");
  return py::make_tuple(per_rank, per_expert, in_rank);
}

// The ids' check in one crossing and one sync of the current stream: the first bad slot of
// topk_idx (launch_check_ids), or -1.
long long first_bad_id(const Tensor& topk_idx, int E) {
  check_tensor(topk_idx, "topk_idx", at::kLong);
  TORCH_CHECK(topk_idx.dim() == 2 && topk_idx.size(1) <= kMaxTopk, "megatron_ep: topk_idx must be [T, K <= ", kMaxTopk,
              "]");
  c10::cuda::CUDAGuard guard(topk_idx.device());
  const int T = (int)topk_idx.size(0), K = (int)topk_idx.size(1);
  const Tensor key = at::zeros({1}, topk_idx.options());
  launch_check_ids(static_cast<const long long*>(topk_idx.data_ptr()), T, K, E,
                   reinterpret_cast<unsigned long long*>(key.data_ptr()), stream());
  check_launch("check_ids");
  const long long k = key.item<int64_t>();  // the sync
  return k == 0 ? -1 : (long long)T * K - k;
}

}  // namespace

namespace {
// The one-crossing entries with the internode path's fused launch (composed.h): _C_nvshmem calls
// them through _C's capsule, so a fused call is one crossing from Python.
py::tuple dispatch_call_with(Runtime& rt, HandleState& st, const Sig& sig, bool first, const Tensor& data,
                             const c10::optional<Tensor>& scales, const c10::optional<Tensor>& topk_w, bool push,
                             bool scratch, bool zero_copy, int out_rows, int worst, int comb_rows,
                             const py::object& previous, const py::object& event, bool async_op, const py::object& hook,
                             const py::object& marks, int num_blocks, int push_blocks, int local_blocks,
                             bool want_src, const FusedDispatch& fused) {
  return dispatch_entry(rt, st, sig, first, data, scales, topk_w, push, scratch, zero_copy, out_rows, worst, comb_rows,
                        previous, event, async_op, hook, marks, num_blocks, push_blocks, local_blocks, want_src, &fused);
}

py::tuple combine_call_with(Runtime& rt, const HandleState& st, const Sig& sig, const Tensor& x,
                            const c10::optional<Tensor>& weights, const c10::optional<Tensor>& bias0,
                            const c10::optional<Tensor>& bias1, int variant, bool zero_copy,
                            const c10::optional<Tensor>& out_y, const c10::optional<Tensor>& out_w,
                            const py::object& previous, const py::object& event, bool async_op,
                            const py::object& hook, const py::object& marks, int num_blocks, int local_blocks,
                            const FusedCombine& fused) {
  return combine_part(rt, st, sig, x, weights, bias0, bias1, variant, zero_copy, out_y, out_w, previous, event, async_op,
                      hook, &fused, marks, num_blocks, local_blocks);
}

const ComposedApi kComposedApi{kComposedApiVersion, &dispatch_first_call, &dispatch_call_with, &combine_call_with};
}  // namespace
}  // namespace mep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_ep CUDA kernels: the shared runtime and the intranode normal path";
  m.attr("CONTROL_BYTES") = (long long)sizeof(mep::Control);
  m.attr("HOST_INFO_BYTES") = (long long)sizeof(mep::HostInfo);
  m.attr("NUM_SIG_FIELDS") = (int)mep::kSigFields;
  m.def("first_bad_id", &mep::first_bad_id, py::arg("topk_idx"), py::arg("num_experts"));
  m.def("layout", &mep::layout, py::arg("topk_idx"), py::arg("num_experts"), py::arg("num_ranks"), py::arg("counts_int32"));
  py::class_<mep::Runtime>(m, "Runtime")
      .def(py::init([](int device, int rank, int num_ranks, const py::object& layout, double timeout_s) {
             auto rt = std::make_unique<mep::Runtime>(device, rank, num_ranks, layout, timeout_s);
             c10::cuda::CUDAGuard guard(device);
             mep::prepare_kernels();  // every intranode kernel resolved before the first call
             return rt;
           }),
           py::arg("device"), py::arg("rank"), py::arg("num_ranks"), py::arg("layout"), py::arg("timeout_s"))
      .def("ipc_handle", &mep::Runtime::ipc_handle)
      .def("open_peers", &mep::Runtime::open_peers)
      .def("close", &mep::Runtime::close)
      .def("view", &mep::Runtime::view)
      .def("base_ptr", &mep::Runtime::base_ptr)
      .def("host_tag", &mep::Runtime::host_tag)
      .def("notified_tag", &mep::Runtime::notified_tag)
      .def("host_counts", &mep::Runtime::host_counts)
      .def("num_aborted", &mep::Runtime::num_aborted)
      .def("error_address", &mep::Runtime::error_address)
      .def("take_error", &mep::Runtime::take_error, py::arg("clear"))
      .def("fail_call", &mep::Runtime::fail_call)
      .def("pool_free_bytes", &mep::Runtime::pool_free_bytes)
      .def("pool_stats", &mep::Runtime::pool_stats)
      .def("set_host_clock", &mep::Runtime::set_host_clock, py::arg("on"))
      .def("host_clock", &mep::Runtime::host_clock, py::arg("reset"))
      .def("set_comm_stream", [](mep::Runtime& rt, const py::object& s) { rt.set_comm_stream(mep::stream_of(s)); });
  auto intra = m.def_submodule("intranode", "the intranode normal path (csrc/intranode/)");
  // the entries _C_nvshmem's internode path composes (composed.h)
  m.attr("_composed_api") = py::capsule(&mep::kComposedApi, mep::kComposedApiName);
  m.attr("COMPOSED_API_VERSION") = mep::kComposedApiVersion;
  py::class_<mep::HandleState>(intra, "HandleState")
      .def(py::init(&mep::handle_state), py::arg("topk_idx"), py::arg("rank_pos"), py::arg("slot_pos"), py::arg("recv_info"), py::arg("row_limits"), py::arg("counts"), py::arg("comb_map"), py::arg("num_experts"), py::arg("permute"))
      // what it was bound from, in the constructor's order (a copied handle binds a copy of them)
      .def("tensors", [](const mep::HandleState& st) {
        return py::make_tuple(st.topk_idx, st.rank_pos, st.slot_pos, st.recv_info, st.row_limits, st.counts,
                              st.comb_map.has_value() ? py::cast(*st.comb_map) : py::none());
      });
  // one crossing per call (calls.h); argument names: the Python side's (megatron_ep/backends/cuda/paths/intranode.py
  // passes them by name; tests/unit/test_kernel_boundary.py reads both sides)
  intra.def("notify_call", &mep::notify_call, py::arg("runtime"), py::arg("sig"), py::arg("topk_idx"), py::arg("num_experts"), py::arg("expert_alignment"), py::arg("permute"), py::arg("num_worst_tokens"), py::arg("token_groups"), py::arg("check_ids"), py::arg("rank_counts"), py::arg("tag"), py::arg("previous_event"), py::arg("marks"), py::arg("wait_s"), py::arg("async_op"));
  intra.def("dispatch_first_call", &mep::dispatch_first_call, py::arg("runtime"), py::arg("sig"), py::arg("topk_idx"), py::arg("num_experts"), py::arg("expert_alignment"), py::arg("permute"), py::arg("token_groups"), py::arg("check_ids"), py::arg("rank_counts"), py::arg("tag"), py::arg("previous_event"), py::arg("notify_marks"), py::arg("wait_s"), py::arg("fits"), py::arg("x"), py::arg("scales"), py::arg("topk_weights"), py::arg("push"), py::arg("scratch"), py::arg("zero_copy"), py::arg("event"), py::arg("async_op"), py::arg("hook"), py::arg("marks"), py::arg("num_blocks"), py::arg("push_blocks"), py::arg("local_blocks"), py::arg("want_src"));
  intra.def("dispatch_call", &mep::dispatch_call, py::arg("runtime"), py::arg("state"), py::arg("sig"), py::arg("first"), py::arg("x"), py::arg("scales"), py::arg("topk_weights"), py::arg("push"), py::arg("scratch"), py::arg("zero_copy"), py::arg("out_rows"), py::arg("num_worst_tokens"), py::arg("comb_rows"), py::arg("previous_event"), py::arg("event"), py::arg("async_op"), py::arg("hook"), py::arg("marks"), py::arg("num_blocks"), py::arg("push_blocks"), py::arg("local_blocks"), py::arg("want_src"));
  intra.def("combine_call", &mep::combine_call, py::arg("runtime"), py::arg("state"), py::arg("sig"), py::arg("x"), py::arg("weights"), py::arg("bias0"), py::arg("bias1"), py::arg("variant"), py::arg("zero_copy"), py::arg("out"), py::arg("out_weights"), py::arg("previous_event"), py::arg("event"), py::arg("async_op"), py::arg("hook"), py::arg("marks"), py::arg("num_blocks"), py::arg("local_blocks"));
}
