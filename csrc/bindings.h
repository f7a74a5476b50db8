// Shared by the CPU and CUDA bindings: argument checks and the conversion of tensor lists into
// the raw-pointer TensorLists the kernels take (csrc/kernels.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
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

// The tensor arguments common to every step. state2 is empty for SGD and Lion; state1 may be
// empty for SGD without momentum (state1_name says which list it is, for messages); state3 is
// Adam's amsgrad max_exp_avg_sqs, empty when amsgrad is off.
struct StepTensors {
  const char* op;
  at::TensorList params, state1, state2, accs, lp_params, grads;
  const char* state1_name;
  const char* state2_name;
  const at::Tensor& steps;
  const at::Tensor& lr;
  const at::Tensor& coef;
  const std::optional<at::Tensor>& found_inf;
  at::TensorList state3 = {};
  const char* state3_name = nullptr;
};

Call prepare_step(const StepTensors& t, double grad_alpha, bool grads_overwrite, bool maximize,
                  StepArgs& args);

// The operator implementations, one per schema in bindings.cpp, for a Backend with
//   static void accumulate(const Call&, const AccumulateArgs&);
//   static void step(const Call&, const StepArgs&, const math::{Sgd,Adam,Lion}Hyper&);
// (CpuBackend in bindings.cpp, CudaBackend in bindings_cuda.cpp).

template <class Backend>
void accumulate_impl(const at::Tensor& acc, const at::Tensor& offsets, at::TensorList grads,
                     double alpha, bool overwrite, const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& sumsq) {
  AccumulateArgs args{static_cast<float>(alpha), overwrite, nullptr, nullptr};
  Call call = prepare_accumulate(acc, offsets, grads, found_inf, sumsq, args);
  if (call.lists.size() > 0) Backend::accumulate(call, args);
  call.finish();
}

template <class Backend, class Hyper>
void run_step(const StepTensors& t, double grad_alpha, bool grads_overwrite, bool maximize,
              const Hyper& hyper) {
  StepArgs args{};
  Call call = prepare_step(t, grad_alpha, grads_overwrite, maximize, args);
  if (call.lists.size() > 0) Backend::step(call, args, hyper);
  call.finish();
}

template <class Backend>
void sgd_step_impl(at::TensorList params, at::TensorList momentum_bufs, at::TensorList accs,
                   const at::Tensor& steps, const at::Tensor& lr, const at::Tensor& coef,
                   double momentum, double dampening, double weight_decay, bool nesterov,
                   bool maximize, at::TensorList lp_params, at::TensorList grads,
                   double grad_alpha, bool grads_overwrite,
                   const std::optional<at::Tensor>& found_inf) {
  const bool has_buf = momentum != 0.0;  // as in torch, no buffer exists without momentum
  const StepTensors t{"sgd_step_", params, has_buf ? momentum_bufs : at::TensorList(), {}, accs,
                      lp_params, grads, has_buf ? "momentum_bufs" : nullptr, nullptr, steps, lr,
                      coef, found_inf};
  run_step<Backend>(t, grad_alpha, grads_overwrite, maximize,
                    math::sgd_hyper(momentum, dampening, weight_decay, nesterov));
}

// Whether Backend's Adam kernel handles amsgrad (TensorLists::state3): a backend says so with
// `static constexpr bool kAmsgrad = true;`. One that does not gets a clear error instead of
// silently ignoring max_exp_avg_sqs.
template <class Backend, class = void>
struct has_amsgrad {
  static constexpr bool value = false;
};
template <class Backend>
struct has_amsgrad<Backend, std::void_t<decltype(Backend::kAmsgrad)>> {
  static constexpr bool value = Backend::kAmsgrad;
};

template <class Backend>
void adam_step_impl(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList accs, const at::Tensor& steps, const at::Tensor& lr,
                    const at::Tensor& coef, double beta1, double beta2, double eps,
                    double weight_decay, bool decoupled, bool maximize, at::TensorList lp_params,
                    at::TensorList grads, double grad_alpha, bool grads_overwrite,
                    const std::optional<at::Tensor>& found_inf) {
  const bool amsgrad = !max_exp_avg_sqs.empty();
  TORCH_CHECK(!amsgrad || has_amsgrad<Backend>::value,
              "adam_step_: amsgrad (a non-empty max_exp_avg_sqs) is not implemented by this "
              "device's kernels yet; use the reference or triton backend for amsgrad");
  const StepTensors t{"adam_step_", params, exp_avgs, exp_avg_sqs, accs, lp_params, grads,
                      "exp_avgs", "exp_avg_sqs", steps, lr, coef, found_inf,
                      max_exp_avg_sqs, amsgrad ? "max_exp_avg_sqs" : nullptr};
  run_step<Backend>(t, grad_alpha, grads_overwrite, maximize,
                    math::adam_hyper(beta1, beta2, eps, weight_decay, decoupled));
}

template <class Backend>
void lion_step_impl(at::TensorList params, at::TensorList exp_avgs, at::TensorList accs,
                    const at::Tensor& steps, const at::Tensor& lr, const at::Tensor& coef,
                    double beta1, double beta2, double weight_decay, bool maximize,
                    at::TensorList lp_params, at::TensorList grads, double grad_alpha,
                    bool grads_overwrite, const std::optional<at::Tensor>& found_inf) {
  const StepTensors t{"lion_step_", params, exp_avgs, {}, accs, lp_params, grads, "exp_avgs",
                      nullptr, steps, lr, coef, found_inf};
  run_step<Backend>(t, grad_alpha, grads_overwrite, maximize,
                    math::lion_hyper(beta1, beta2, weight_decay));
}

// Registers the implementations above for one dispatch key (CPU, CUDA).
template <class Backend>
void register_impls(torch::Library& m) {
  m.impl("accumulate_", &accumulate_impl<Backend>);
  m.impl("sgd_step_", &sgd_step_impl<Backend>);
  m.impl("adam_step_", &adam_step_impl<Backend>);
  m.impl("lion_step_", &lion_step_impl<Backend>);
}

}  // namespace binding
}  // namespace fused_accum
