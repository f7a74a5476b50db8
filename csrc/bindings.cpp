// fused_accum._C: the CPU implementations of the fused_accum_ext:: operators, and the argument
// checks shared with the CUDA implementations (bindings_cuda.cpp). The operators' schemas are
// declared once, in fused_accum/ops.py, and defined from there (fused_accum/backends/ext.py).
//
// Tensors stop here: the checks name the argument and what was expected, strided inputs are made
// contiguous, and the kernels receive raw pointers (csrc/kernels.h).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bindings.h"

namespace fused_accum {
namespace binding {
namespace {

DType dtype_code(const at::Tensor& t, const char* op, const char* name, size_t i) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    default:
      TORCH_CHECK(false, op, ": ", name, "[", i, "] must be float32, bfloat16 or float16, got ",
                  t.scalar_type());
  }
}

// Checks that list element `t` (name[i]) is defined, on `device` and has `numel` elements.
void check_element(const at::Tensor& t, const char* op, const char* name, size_t i,
                   const at::Device& device, int64_t numel, const char* numel_of) {
  TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
  TORCH_CHECK(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(),
              ", expected ", device, " (the device of the other tensors)");
  TORCH_CHECK(t.numel() == numel, op, ": ", name, "[", i, "] has ", t.numel(),
              " elements but ", numel_of, "[", i, "] has ", numel);
}

void check_f32(const at::Tensor& t, const char* op, const char* name, size_t i) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, "[", i, "] must be float32, got ",
              t.scalar_type());
}

// A one-element float32 tensor on `device` (coef, found_inf, sumsq).
void check_scalar(const at::Tensor& t, const char* op, const char* name, const at::Device& device) {
  TORCH_CHECK(t.defined() && t.numel() == 1 && t.scalar_type() == at::kFloat, op, ": ", name,
              " must be a one-element float32 tensor, got ", t.scalar_type(), " of shape ",
              t.sizes());
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), ", expected ", device,
              " (the device of the tensor lists)");
}

// lr: a one-element float64 tensor (the optimizer's: a Python float lr keeps every bit, as
// torch's fused optimizers take it) or float32 (widened to double, exactly, by prepare_step).
void check_lr(const at::Tensor& t, const char* op, const at::Device& device) {
  TORCH_CHECK(t.defined() && t.numel() == 1 &&
                  (t.scalar_type() == at::kDouble || t.scalar_type() == at::kFloat),
              op, ": lr must be a one-element float64 or float32 tensor, got ", t.scalar_type(),
              " of shape ", t.sizes());
  TORCH_CHECK(t.device() == device, op, ": lr is on ", t.device(), ", expected ", device,
              " (the device of the tensor lists)");
}

void check_length(size_t got, size_t want, const char* op, const char* name, const char* of) {
  TORCH_CHECK(got == want, op, ": ", name, " has ", got, " tensors but ", of, " has ", want);
}

// A tensor the kernel reads: itself when contiguous, else a contiguous copy kept alive.
void* readable(Call& call, const at::Tensor& t) {
  if (t.is_contiguous()) return t.data_ptr();
  call.keep_alive.push_back(t.contiguous());
  return call.keep_alive.back().data_ptr();
}

// A tensor the kernel writes: itself when contiguous, else a copy written back by finish().
void* writable(Call& call, const at::Tensor& t) {
  if (t.is_contiguous()) return t.data_ptr();
  call.write_back.emplace_back(t, t.contiguous());
  return call.write_back.back().second.data_ptr();
}

}  // namespace

Call prepare_accumulate(const at::Tensor& acc, const at::Tensor& offsets, at::TensorList grads,
                        const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& sumsq, AccumulateArgs& args) {
  // The same checks as slice_starts in fused_accum/backends/reference.py.
  const char* op = "accumulate_";
  Call call;
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.dim() == 1 && acc.is_contiguous(), op,
              ": acc must be a 1-D contiguous float32 tensor (the flat accumulator), got ",
              acc.scalar_type(), " of shape ", acc.sizes(), " and strides ", acc.strides());
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_cpu(), op,
              ": offsets must be a 1-D int64 CPU tensor, got ", offsets.scalar_type(),
              " of shape ", offsets.sizes(), " on ", offsets.device());
  TORCH_CHECK(offsets.numel() == static_cast<int64_t>(grads.size()), op, ": offsets has ",
              offsets.numel(), " entries but grads has ", grads.size(), " tensors");
  call.device = acc.device();
  if (found_inf) check_scalar(*found_inf, op, "found_inf", call.device);
  if (sumsq) check_scalar(*sumsq, op, "sumsq", call.device);
  args.found_inf = found_inf ? found_inf->data_ptr<float>() : nullptr;
  args.sumsq = sumsq ? sumsq->data_ptr<float>() : nullptr;
  const at::Tensor starts = offsets.contiguous();
  const int64_t* start = starts.data_ptr<int64_t>();
  float* const base = acc.data_ptr<float>();
  int64_t end = 0;  // where the previous slice ends
  TensorLists& l = call.lists;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& grad = grads[i];
    TORCH_CHECK(grad.defined(), op, ": grads[", i, "] is undefined");
    TORCH_CHECK(grad.device() == call.device, op, ": grads[", i, "] is on ", grad.device(),
                ", expected ", call.device, " (the device of acc)");
    const DType grad_dtype = dtype_code(grad, op, "grads", i);
    TORCH_CHECK(start[i] >= end, op, ": offsets[", i, "] is ", start[i], ", before ", end,
                ", where the previous slice ends (0 for the first): slices must be in increasing "
                "order and must not overlap");
    const int64_t numel = grad.numel();
    // Compared before adding: start + numel could overflow for a huge offset.
    TORCH_CHECK(numel <= acc.numel() - start[i], op, ": grads[", i, "] (", numel,
                " elements at offset ", start[i], ") runs past the end of acc (", acc.numel(),
                " elements)");
    end = start[i] + numel;
    if (numel == 0) continue;
    l.numel.push_back(numel);
    l.index.push_back(static_cast<int64_t>(i));
    l.acc.add(base + start[i], DType::kF32);
    l.grad.add(readable(call, grad), grad_dtype);
  }
  return call;
}

Call prepare_fold_pieces(const at::Tensor& acc, at::TensorList pieces, bool overwrite,
                         FoldArgs& args) {
  const char* op = "fold_pieces";
  Call call;
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.dim() == 1 && acc.is_contiguous(), op,
              ": acc must be a 1-D contiguous float32 tensor, got ", acc.scalar_type(),
              " of shape ", acc.sizes(), " and strides ", acc.strides());
  TORCH_CHECK(!pieces.empty(), op, ": pieces is empty (at least one piece is needed)");
  call.device = acc.device();
  const at::ScalarType dtype = pieces[0].scalar_type();
  for (size_t i = 0; i < pieces.size(); ++i) {
    const at::Tensor& piece = pieces[i];
    TORCH_CHECK(piece.defined(), op, ": pieces[", i, "] is undefined");
    TORCH_CHECK(piece.scalar_type() == at::kFloat || piece.scalar_type() == at::kBFloat16 ||
                    piece.scalar_type() == at::kHalf,
                op, ": pieces[", i, "] must be bfloat16, float16 or float32, got ",
                piece.scalar_type());
    TORCH_CHECK(piece.scalar_type() == dtype, op, ": pieces[", i, "] is ", piece.scalar_type(),
                " but pieces[0] is ", dtype, " (all pieces must have one dtype)");
    TORCH_CHECK(piece.device() == call.device, op, ": pieces[", i, "] is on ", piece.device(),
                ", expected ", call.device, " (the device of acc)");
    TORCH_CHECK(piece.numel() == acc.numel(), op, ": pieces[", i, "] has ", piece.numel(),
                " elements but acc has ", acc.numel());
  }
  args.acc = acc.data_ptr<float>();
  args.numel = acc.numel();
  args.dtype = dtype_code(pieces[0], op, "pieces", 0);
  args.overwrite = overwrite;
  for (const at::Tensor& piece : pieces) args.pieces.push_back(readable(call, piece));
  return call;
}

Call prepare_step(const StepTensors& t, const StepStates& states, bool maximize, StepArgs& args,
                  bool writes_params) {
  const char* op = t.op;
  Call call;
  const size_t n = t.params.size();
  check_length(t.accs.size(), n, op, "accs", "params");
  for (const StateList& s : states) {
    if (s.name) check_length(s.list.size(), n, op, s.name, "params");
  }
  TORCH_CHECK(t.lp_params.empty() || t.lp_params.size() == n, op, ": lp_params has ",
              t.lp_params.size(), " tensors, expected 0 (none) or ", n, " (one per param)");
  TORCH_CHECK(t.grads.empty() || t.grads.size() == n, op, ": grads has ", t.grads.size(),
              " tensors, expected 0 (no fused micro-batch) or ", n, " (one per param)");
  // The same checks, in the same words, as reference.check_remainders.
  const bool has_rem = !t.remainders.empty();
  TORCH_CHECK(!has_rem || t.remainders.size() == n, op, ": remainders has ", t.remainders.size(),
              " tensors, expected 0 (none) or ", n, " (one per param)");
  TORCH_CHECK(!has_rem || t.lp_params.empty(), op,
              ": remainders and lp_params are exclusive: with remainders, params are the bf16 "
              "parameters");
  call.device = n > 0 ? t.params[0].device() : t.lr.device();
  check_lr(t.lr, op, call.device);
  check_scalar(t.coef, op, "coef", call.device);
  if (t.found_inf) check_scalar(*t.found_inf, op, "found_inf", call.device);
  TORCH_CHECK(t.steps.dim() == 1 && t.steps.numel() == static_cast<int64_t>(n) &&
                  t.steps.scalar_type() == at::kFloat && t.steps.is_contiguous(),
              op, ": steps must be a contiguous 1-D float32 tensor of ", n,
              " step counts (one per param), got ", t.steps.scalar_type(), " of shape ",
              t.steps.sizes());
  TORCH_CHECK(t.steps.device() == call.device, op, ": steps is on ", t.steps.device(),
              ", expected ", call.device);
  // The kernels read a double (kernels.h). A float32 lr is widened on its device (a copy
  // enqueued on the current stream: no host sync, and capturable in a CUDA graph).
  if (t.lr.scalar_type() == at::kDouble) {
    args.lr = t.lr.data_ptr<double>();
  } else {
    call.keep_alive.push_back(t.lr.to(at::kDouble));
    args.lr = call.keep_alive.back().data_ptr<double>();
  }
  args.coef = t.coef.data_ptr<float>();
  args.steps = t.steps.data_ptr<float>();
  args.found_inf = t.found_inf ? t.found_inf->data_ptr<float>() : nullptr;
  args.grad_alpha = static_cast<float>(t.grad_alpha);
  args.grads_overwrite = t.grads_overwrite;
  args.maximize = maximize;

  // Sources: one per tensor of each written list, list after list (ops.StepTensors.sources;
  // the same checks, in the same words, as reference.take_sources).
  const bool has_lp = !t.lp_params.empty();
  std::vector<std::pair<int, at::TensorList>> sourced{{TensorLists::kParam, t.params}};
  if (has_lp) sourced.emplace_back(TensorLists::kLp, t.lp_params);
  if (has_rem) sourced.emplace_back(TensorLists::kRem, t.remainders);
  for (size_t k = 0; k < kMaxStates; ++k) {
    if (states[k].name) sourced.emplace_back(TensorLists::kState1 + static_cast<int>(k), states[k].list);
  }
  const bool has_sources = !t.sources.empty();
  TORCH_CHECK(!has_sources || t.sources.size() == sourced.size() * n, op, ": sources has ",
              t.sources.size(), " tensors, expected 0 (none) or ", sourced.size() * n,
              " (one per tensor of the ", sourced.size(), " lists the step writes)");

  TensorLists& l = call.lists;
  Operand* const state_operands[kMaxStates] = {&l.state1, &l.state2, &l.state3};
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = t.params[i];
    TORCH_CHECK(p.defined(), op, ": params[", i, "] is undefined");
    const int64_t numel = p.numel();
    check_element(p, op, "params", i, call.device, numel, "params");
    const DType param_dtype = dtype_code(p, op, "params", i);
    check_element(t.accs[i], op, "accs", i, call.device, numel, "params");
    check_f32(t.accs[i], op, "accs", i);
    for (const StateList& s : states) {
      if (!s.name) continue;
      check_element(s.list[i], op, s.name, i, call.device, numel, "params");
      check_f32(s.list[i], op, s.name, i);
    }
    if (!t.lp_params.empty()) {
      check_element(t.lp_params[i], op, "lp_params", i, call.device, numel, "params");
      dtype_code(t.lp_params[i], op, "lp_params", i);
    }
    if (!t.grads.empty()) {
      check_element(t.grads[i], op, "grads", i, call.device, numel, "params");
      dtype_code(t.grads[i], op, "grads", i);
    }
    if (has_rem) {
      const at::Tensor& r = t.remainders[i];
      TORCH_CHECK(p.scalar_type() == at::kBFloat16, op, ": params[", i,
                  "] must be bfloat16 with remainders (the fp32 master is the bf16 parameter "
                  "plus an int16 remainder), got ", p.scalar_type());
      TORCH_CHECK(r.defined(), op, ": remainders[", i, "] is undefined");
      TORCH_CHECK(r.scalar_type() == at::kShort, op, ": remainders[", i, "] must be int16, got ",
                  r.scalar_type());
      TORCH_CHECK(r.device() == call.device, op, ": remainders[", i, "] is on ", r.device(),
                  ", expected ", call.device, " (the device of params[", i, "])");
      TORCH_CHECK(r.numel() == numel, op, ": remainders[", i, "] has ", r.numel(),
                  " elements but params[", i, "] has ", numel);
    }
    if (numel == 0) continue;
    l.numel.push_back(numel);
    l.index.push_back(static_cast<int64_t>(i));
    if (writes_params) l.param.add(writable(call, p), param_dtype);
    l.acc.add(readable(call, t.accs[i]), DType::kF32);
    for (size_t k = 0; k < kMaxStates; ++k) {
      if (states[k].name) state_operands[k]->add(writable(call, states[k].list[i]), DType::kF32);
    }
    if (!t.lp_params.empty() && writes_params) {
      const at::Tensor& lp = t.lp_params[i];
      l.lp.add(writable(call, lp), dtype_code(lp, op, "lp_params", i));
    }
    if (has_rem && writes_params) l.rem.add(writable(call, t.remainders[i]), DType::kI16);
    if (!t.grads.empty()) {
      l.grad.add(readable(call, t.grads[i]), dtype_code(t.grads[i], op, "grads", i));
    }
  }
  if (has_sources) {
    for (size_t k = 0; k < sourced.size(); ++k) {
      const auto& [which, list] = sourced[k];
      for (size_t i = 0; i < n; ++i) {
        const at::Tensor& dst = list[i];
        const at::Tensor& src = t.sources[k * n + i];
        TORCH_CHECK(src.defined() && src.scalar_type() == dst.scalar_type() &&
                        src.numel() == dst.numel() && src.device() == dst.device(),
                    op, ": sources[", k * n + i, "] must be ", dst.scalar_type(), " with ",
                    dst.numel(), " elements on ", dst.device(), " (what the step writes there), got ",
                    src.defined() ? src.scalar_type() : at::ScalarType::Undefined, " with ",
                    src.defined() ? src.numel() : 0, " on ", src.defined() ? src.device() : dst.device());
        if (dst.numel() == 0) continue;
        // the written tensor's dtype code (kI16 for remainders), for its element size
        const DType dt = which == TensorLists::kRem ? DType::kI16 : dtype_code(dst, op, "sources", k * n + i);
        l.source[which].add(readable(call, src), dt);
      }
    }
  }
  return call;
}

}  // namespace binding

// ---- CPU ----------------------------------------------------------------------------------------

namespace {

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f) {
  at::parallel_for(begin, end, grain, f);
}

struct CpuBackend {
  using Call = binding::Call;
  static void accumulate(const Call& c, const AccumulateArgs& a) {
    accumulate_cpu(c.lists, a, parallel_for);
  }
  static void fold_pieces(const Call&, const FoldArgs& f) { fold_pieces_cpu(f, parallel_for); }
  template <class Algo>
  static void step(const Call& c, const StepArgs& a, const typename Algo::Hyper& h) {
    step_cpu<Algo>(c.lists, a, h, parallel_for);
  }
};

}  // namespace
}  // namespace fused_accum

// fused_accum._C.swap_storages (registered in module.cpp; fused_accum.extension.swap_storages):
// swap the memory of two same-sized CPU buffers in O(1) by exchanging their StorageImpls'
// DataPtrs, so that every view of either (opt.state's tensors, cached slot views) sees the
// other's memory without an op per view. Each DataPtr keeps its deleter, so each block is freed
// once, by whichever storage holds it last. Version counters are the tensors' (untouched).
namespace fused_accum {
void swap_storages(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.defined() && b.defined(), "swap_storages: both tensors must be defined");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "swap_storages: both tensors must be on the CPU, got ",
              a.device(), " and ", b.device());
  const c10::Storage& sa = a.storage();
  const c10::Storage& sb = b.storage();
  TORCH_CHECK(!sa.is_alias_of(sb) && sa.unsafeGetStorageImpl() != sb.unsafeGetStorageImpl(),
              "swap_storages: the two tensors share their storage");
  TORCH_CHECK(a.storage_offset() == 0 && b.storage_offset() == 0 && a.is_contiguous() && b.is_contiguous() &&
                  static_cast<size_t>(a.nbytes()) == sa.nbytes() && static_cast<size_t>(b.nbytes()) == sb.nbytes(),
              "swap_storages: each tensor must be the whole of its storage (contiguous, offset 0, all its bytes)");
  TORCH_CHECK(sa.nbytes() == sb.nbytes(), "swap_storages: the storages differ in size (", sa.nbytes(), " and ",
              sb.nbytes(), " bytes)");
  TORCH_CHECK(sa.allocator() == sb.allocator(),
              "swap_storages: the storages come from different allocators (one pinned and one pageable, or one "
              "moved into shared memory by share_memory_()): their memory cannot be exchanged");
  c10::StorageImpl* ia = sa.unsafeGetStorageImpl();
  c10::StorageImpl* ib = sb.unsafeGetStorageImpl();
  at::DataPtr from_a = ia->set_data_ptr(at::DataPtr(nullptr, a.device()));
  at::DataPtr from_b = ib->set_data_ptr(std::move(from_a));
  ia->set_data_ptr(std::move(from_b));
}
}  // namespace fused_accum

// No TORCH_LIBRARY here: the schemas are defined from Python, from the declarations in
// fused_accum/ops.py (fused_accum/backends/ext.py defines them once _C is loaded), and the
// dispatcher checks the kernels' parameter types (bindings.h) against them.
TORCH_LIBRARY_IMPL(fused_accum_ext, CPU, m) {
  fused_accum::binding::register_impls<fused_accum::CpuBackend>(m);
}
