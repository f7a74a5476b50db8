// Shared by the CPU and CUDA bindings: argument checks and the conversion of tensor lists into
// the raw-pointer TensorLists the kernels take (csrc/kernels.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <array>
#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "kernels.h"

namespace fused_accum {
namespace binding {

// The kernels' view of one call, plus what must outlive the launch: contiguous copies of
// strided inputs, and of strided outputs, which finish() copies back into the caller's tensors.
struct Call {
  TensorLists lists;
  at::Device device{at::kCPU};
  std::vector<at::Tensor> keep_alive;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (caller's tensor, copy)
  void finish() {
    for (auto& [dst, src] : write_back) dst.copy_(src);
  }
};

Call prepare_accumulate(const at::Tensor& acc, const at::Tensor& offsets, at::TensorList grads,
                        const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& sumsq, AccumulateArgs& args);

// fused_accum.ops.FoldPieces: the same checks, in the same words, as
// reference.check_fold_pieces; strided pieces are read through contiguous copies.
Call prepare_fold_pieces(const at::Tensor& acc, at::TensorList pieces, bool overwrite,
                         FoldArgs& args);

// ---- the step ops' arguments --------------------------------------------------------------------
//
// Declared once, in fused_accum/ops.py: each step op's schema is StepTensors' fields, then the
// op's state lists, then its hyper-parameter record's fields. The kernels below take them in that
// order, with the C++ types of the schema's (Tensor[] -> at::TensorList, Tensor -> const
// at::Tensor&, Tensor? -> const std::optional<at::Tensor>&, float -> double, float? ->
// std::optional<double>, bool -> bool); the
// dispatcher compares these types with the schema when fused_accum defines it, and refuses a
// mismatch, naming the argument.

// The parameters every step op starts with: fused_accum.ops.StepTensors, field by field.
#define FUSED_ACCUM_STEP_PARAMETERS                                                           \
  at::TensorList params, at::TensorList accs, const at::Tensor &steps, const at::Tensor &lr, \
      const at::Tensor &coef, at::TensorList lp_params, at::TensorList remainders,            \
      at::TensorList grads, const std::optional<at::Tensor> &found_inf, double grad_alpha,    \
      bool grads_overwrite, at::TensorList sources
// ... gathered into the StepTensors below, in a kernel of FUSED_ACCUM_STEP_PARAMETERS.
#define FUSED_ACCUM_STEP_TENSORS(op)                                                        \
  StepTensors {                                                                             \
    op, params, accs, steps, lr, coef, lp_params, remainders, grads, found_inf, grad_alpha, \
        grads_overwrite, sources                                                            \
  }

struct StepTensors {
  const char* op;  // for messages: the operator's name
  at::TensorList params, accs;
  const at::Tensor& steps;
  const at::Tensor& lr;
  const at::Tensor& coef;
  at::TensorList lp_params;
  // int16 low halves of bf16 params' fp32 masters (exact 2-byte masters, issue 28): when
  // given, params are the bf16 parameters themselves and lp_params is empty
  at::TensorList remainders;
  at::TensorList grads;
  const std::optional<at::Tensor>& found_inf;
  double grad_alpha;
  bool grads_overwrite;
  // empty, or where the step reads the old values of every written list's tensors, list after
  // list (ops.StepTensors.sources: an out-of-place step)
  at::TensorList sources;
};

// An op's optimizer-state lists, TensorLists::state1..state3 in order (fp32, written). A list the
// call does not use (math.h: the algorithm's uses_state; and past its kStateLists) has a null
// name and is not read.
struct StateList {
  at::TensorList list;
  const char* name = nullptr;  // the schema's name, for messages
};
constexpr size_t kMaxStates = 3;
using StepStates = std::array<StateList, kMaxStates>;

// writes_params false (a step that reads and writes no parameter: math.h's kWritesParam): params,
// lp_params and remainders are checked as usual but not handed to the kernels.
Call prepare_step(const StepTensors& t, const StepStates& states, bool maximize, StepArgs& args,
                  bool writes_params = true);

// The operator implementations, one per operator of fused_accum/ops.py, for a Backend with
//   static void accumulate(const Call&, const AccumulateArgs&);
//   static void fold_pieces(const Call&, const FoldArgs&);
//   template <class Algo> static void step(const Call&, const StepArgs&, const typename Algo::Hyper&);
// (CpuBackend in bindings.cpp, CudaBackend in bindings_cuda.cpp).

// fused_accum.ops.Accumulate (csrc/hooks.cpp calls it with this signature, through the dispatcher).
template <class Backend>
void accumulate_impl(const at::Tensor& acc, const at::Tensor& offsets, at::TensorList grads,
                     double alpha, bool overwrite, const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& sumsq) {
  AccumulateArgs args{static_cast<float>(alpha), overwrite, nullptr, nullptr};
  Call call = prepare_accumulate(acc, offsets, grads, found_inf, sumsq, args);
  if (call.lists.size() > 0) Backend::accumulate(call, args);
  call.finish();
}

// fused_accum.ops.fold_pieces.
template <class Backend>
void fold_pieces_impl(const at::Tensor& acc, at::TensorList pieces, bool overwrite) {
  FoldArgs args;
  Call call = prepare_fold_pieces(acc, pieces, overwrite, args);
  if (args.numel > 0) Backend::fold_pieces(call, args);
}

// The step op of algorithm Algo (math.h), fused_accum.ops.<name>_step: StepTensors, then one
// at::TensorList per state list (Algo::kStateLists), then the hyper-parameters Algo::hyper takes
// (their types deduced from it: Hyper(*)(H...)), then maximize (where Algo::kMaximize).
template <class Backend, class Algo>
void step_impl(const StepTensors& t, const at::TensorList (&given)[math::kStateCount<Algo>],
               const typename Algo::Hyper& h, bool maximize) {
  StepStates states;
  for (int i = 0; i < math::kStateCount<Algo>; ++i) {
    if (Algo::uses_state(i, h, !given[i].empty())) states[i] = {given[i], Algo::kStateLists[i]};
  }
  // A split step's ops (math.h: kWritesParam, kReadsInput) step each whole tensor in place
  // (the reference's message)
  constexpr bool kSplit = !Algo::kWritesParam || Algo::kReadsInput;
  TORCH_CHECK(!kSplit || t.sources.empty(), t.op, ": sources are not supported by a split step");
  StepArgs args{};
  if constexpr (Algo::kReadsInput) {
    // the input (its first list) read where the gradient is, as-is (prepare_step checks it as it
    // checks grads, and reads a strided one through a contiguous copy); no window gradient
    const StepTensors input{t.op, t.params, t.accs, t.steps, t.lr, t.coef, t.lp_params, t.remainders,
                            given[0], t.found_inf, 1.0, true, t.sources};
    Call call = prepare_step(input, states, maximize, args);
    if constexpr (Algo::kShaped) {
      for (size_t i = 0; i < given[0].size(); ++i) {
        TORCH_CHECK(given[0][i].dim() == 2, t.op, ": ", Algo::kStateLists[0], "[", i,
                    "] must be a matrix (2-D), got shape ", given[0][i].sizes());
      }
      for (const int64_t i : call.lists.index) call.lists.rows.push_back(given[0][i].size(0));
    }
    if (call.lists.size() > 0) Backend::template step<Algo>(call, args, h);
    call.finish();
  } else {
    Call call = prepare_step(t, states, maximize, args, Algo::kWritesParam);
    if (call.lists.size() > 0) Backend::template step<Algo>(call, args, h);
    call.finish();
  }
}

template <size_t>
using StateListArgument = at::TensorList;
template <class Backend, class Algo, bool kMaximize = Algo::kMaximize, class HyperFunction = decltype(&Algo::hyper),
          class Lists = std::make_index_sequence<math::kStateCount<Algo>>>
struct StepImpl;
template <class Backend, class Algo, class... H, size_t... k>
struct StepImpl<Backend, Algo, true, typename Algo::Hyper (*)(H...), std::index_sequence<k...>> {
  static void run(FUSED_ACCUM_STEP_PARAMETERS, StateListArgument<k>... lists, H... hyper, bool maximize) {
    const at::TensorList given[] = {lists...};
    step_impl<Backend, Algo>(FUSED_ACCUM_STEP_TENSORS(Algo::kOp), given, Algo::hyper(hyper...), maximize);
  }
};
template <class Backend, class Algo, class... H, size_t... k>
struct StepImpl<Backend, Algo, false, typename Algo::Hyper (*)(H...), std::index_sequence<k...>> {
  static void run(FUSED_ACCUM_STEP_PARAMETERS, StateListArgument<k>... lists, H... hyper) {
    const at::TensorList given[] = {lists...};
    step_impl<Backend, Algo>(FUSED_ACCUM_STEP_TENSORS(Algo::kOp), given, Algo::hyper(hyper...), false);
  }
};

// Registers the implementations above for one dispatch key (CPU, CUDA). The operators are not
// defined yet when _C loads: fused_accum/backends/ext.py defines them next, and the dispatcher
// then checks each of these functions' parameter types against its schema.
template <class Backend>
void register_impls(torch::Library& m) {
  m.impl("accumulate_", &accumulate_impl<Backend>);
  m.impl("fold_pieces_", &fold_pieces_impl<Backend>);
#define FA_REGISTER_STEP(A) m.impl(math::A::kOp, &StepImpl<Backend, math::A>::run);
  FUSED_ACCUM_ALGORITHMS(FA_REGISTER_STEP)
#undef FA_REGISTER_STEP
}

}  // namespace binding
}  // namespace fused_accum
