// The element-wise update rules of every op, written once for the CPU and the CUDA kernels.
//
// Each function mirrors one formula of fused_accum/backends/reference.py, in the same order of
// operations and with the same fused multiply-adds, so that the kernels round where the reference
// rounds. Those orders are the ones of torch's fused CPU optimizers (torch 2.13,
// aten/src/ATen/native/cpu/Fused{Adam,SGD}Kernel.cpp as compiled: GCC contracts their
// `a * b + c` into FMAs, and probing the binary on random data shows which product each FMA
// takes), so fp32 params step bit-for-bit as torch.optim.{SGD,Adam,AdamW}(fused=True) on the
// CPU. Every FMA is written as fmaf(): the kernels are built with -ffp-contract=off, so no other
// expression is contracted behind our back (nvcc contracts by default: build with -fmad=false).
//
// Per-tensor quantities (Adam's bias corrections and step size, the decoupled decay factor, SGD's
// -lr and first-step flag, Lion's lr and decay factor) are computed once per tensor by the
// *_scalars() functions, in double as torch does, then rounded to float once. They start from
// lr as a double: torch's fused CPU optimizers take lr as a double (a tensor lr as
// lr.item<double>()). An lr rounded to fp32 first rounds twice: at lr = 1e-3 and beta1 = 0.9,
// Adam's step size is then 1 ulp away in 70 of the first 1,000 steps (all before step 160, while
// the bias correction is not yet 1 in double). Per-element hyperparameters are floats: torch's
// kernels (and the reference, multiplying fp32 tensors by Python floats) round them to fp32 first.
//
// No dependency beyond <math.h>, <stdint.h> and <optional> (a hyper-parameter that may be None): the
// standalone unit tests (csrc/tests) compile this header with the host compiler alone, and the .cu files compile it with nvcc without torch's headers.
#pragma once

#include <math.h>
#include <stdint.h>

#include <optional>

#if defined(__CUDACC__)
#define FA_HD __host__ __device__ __forceinline__
#define FA_HD_ALWAYS_INLINE FA_HD
#else
#define FA_HD inline
// split_master / rebuild_master run inside the CPU's fused update loops, which vectorise only if
// they are inlined there (GCC 13 declined on its own: the Adam loops then ran scalar, 7x slower)
#define FA_HD_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

namespace fused_accum {
namespace math {

// ---- accumulate -----------------------------------------------------------------------------

// acc = alpha * grad + (0 if overwrite else acc). On overwrite acc is never read, so a NaN left
// in a freshly reused buffer cannot leak into the result.
FA_HD float accumulate(float acc, float grad, float alpha, bool overwrite) {
  const float scaled = grad * alpha;
  return overwrite ? scaled : acc + scaled;
}

// True for +-inf and NaN (NaN fails every ordered comparison). A comparison rather than
// isfinite() so that compilers vectorise it on the CPU.
FA_HD bool nonfinite(float x) { return !(fabsf(x) <= 3.40282347e38f); }

// ---- the gradient a step uses -----------------------------------------------------------------

// coef * (accumulated gradient), negated when maximising. `fused` adds the window's last
// micro-batch (grad) on the fly, as accumulate() would have, without writing acc.
struct GradScalars {
  float coef;
  float grad_alpha;
  bool fused;           // a last micro-batch gradient is fused into this step
  bool grads_overwrite; // ... and it replaces acc instead of adding to it
  bool maximize;
};

// The negation is folded into the coefficient (rounding commutes with negation, so this is
// exactly -(g * coef)): the element loop then has no branch on maximize and vectorises.
FA_HD float effective_grad(float acc, float grad, const GradScalars& s) {
  const float g = s.fused ? accumulate(acc, grad, s.grad_alpha, s.grads_overwrite) : acc;
  return g * (s.maximize ? -s.coef : s.coef);
}

// ---- the algorithms ---------------------------------------------------------------------------
//
// An elementwise algorithm is one trait struct here, and one entry in FUSED_ACCUM_ALGORITHMS:
// the CPU step (csrc/cpu/kernels.cpp), the CUDA step (csrc/cuda/step.cu) and the bindings
// (csrc/bindings.h: the fused_accum_ext::<kOp> kernel, its arguments and checks) are templates
// over the trait, instantiated once per entry of the list. A trait has:
//   kOp              the operator's name, fused_accum_ext::<kOp> (its schema: fused_accum/ops.py)
//   kStateLists      its state-list arguments' names, in the schema's order: the kernels'
//                    TensorLists::state1..state3 (fp32, one tensor per param, written)
//   Hyper, hyper()   the hyper-parameters, built from the schema's hyper-parameter arguments:
//                    hyper()'s parameters are those arguments, in order and in the types the
//                    kernel takes (float -> double, float? -> std::optional<double>, bool ->
//                    bool), the record's final `maximize`
//                    excepted (every step op ends with it: StepArgs::maximize)
//   uses_state(k, h, given)   whether a call uses state list k (given: the list is not empty)
//   Scalars, scalars(lr, step, h)   the per-tensor quantities, once per tensor (lr a double,
//                    step the tensor's step count)
//   kModes, mode(h, s, state3)   the branches that are the same for every element of a tensor,
//                    as a number in [0, kModes): the CPU loops take it as a template constant
//                    (straight-line loops that vectorise), CUDA as a uniform branch
//   reads(mode), writes(mode)   bit k: update<mode> reads / writes state k + 1
//   update<kMode>(g, p, s1, s2, s3, h, s, divide)   one element: g the gradient the step uses,
//                    p the fp32 param (master), s1..s3 its states; `divide` divides by the
//                    per-tensor constant divisor(s), where the trait has one (Adam's bias
//                    correction; csrc/cpu/kernels.cpp passes an exact divide without the divider)
//   the defaults of StepTraits, which every trait derives from, where its op differs (a split
//                    step's elementwise ops: Muon's prologue and epilogue):
//     kWritesParam   false: the op neither reads nor writes a parameter (nor lp_params or
//                    remainders): Muon's prologue writes only its states (the momentum and
//                    the middle's input)
//     kReadsInput    true: the op reads no gradient (acc and a fused micro-batch are not
//                    read, coef is not applied): its first list is its per-element input,
//                    read where the gradient is (any float dtype, any strides: the binding
//                    puts it in TensorLists::grad) and handed to update() as g. Muon's
//                    epilogue reads the middle's output so
//     kShaped        true: scalars(lr, step, h, rows, columns) take the tensor's matrix shape
//                    (its first list's tensors are 2-D: TensorLists::rows): Muon's adjusted lr
//     kMaximize      false: the op's hyper-parameters end without maximize (torch.optim.Muon
//                    has none): hyper() takes every one of them
//   kCudaMinBlocks[k]   the CUDA step kernels' __launch_bounds__ blocks per SM, one per kernel
//                    the algorithm has: without (0) and with (1) an optional third state list
//                    (Adam's amsgrad); one entry where it has no third list, or one every mode
//                    uses (kState3Required: one kernel, with it). Each the largest that compiles
//                    without a spill (scripts/check_cuda_build.sh gates it on sm_90)
#define FUSED_ACCUM_ALGORITHMS(X) X(Sgd) X(Adam) X(Lion) X(Adagrad) X(Ademamix) X(MuonPrologue) X(MuonEpilogue)

// The defaults of every trait (see above): an op that reads the window's gradient and updates
// the parameter, with per-tensor scalars of (lr, step) and maximize last among its arguments.
struct StepTraits {
  static constexpr bool kWritesParam = true;
  static constexpr bool kReadsInput = false;
  static constexpr bool kShaped = false;
  static constexpr bool kMaximize = true;
};

// How many state lists algorithm Algo's op takes.
template <class Algo>
constexpr int kStateCount = sizeof(Algo::kStateLists) / sizeof(Algo::kStateLists[0]);

// Whether every mode of Algo reads or writes its third state list (a state it always keeps, not
// one a hyper-parameter turns on): then a call always has the list, and CUDA compiles only its
// kernel with the third operand.
template <class Algo, int kMode = 0>
constexpr bool every_mode_uses_state3() {
  if constexpr (kMode == Algo::kModes) {
    return true;
  } else {
    return ((Algo::reads(kMode) | Algo::writes(kMode)) & 4u) != 0 && every_mode_uses_state3<Algo, kMode + 1>();
  }
}
template <class Algo>
constexpr bool kState3Required = kStateCount<Algo> >= 3 && every_mode_uses_state3<Algo>();

// a / b, correctly rounded: the plain divide (the default `divide` of every update).
struct Divide {
  FA_HD float operator()(float a, float b) const { return a / b; }
};

// ---- SGD (torch.optim.SGD) --------------------------------------------------------------------

struct SgdHyper {
  float momentum, one_minus_dampening, weight_decay;
  bool nesterov;
  bool momentum_buffers;  // momentum != 0 in double: torch keeps a buffer (ops.SgdStates)
};
struct SgdScalars {
  float neg_lr;    // -lr: the update is one FMA, param + g * (-lr), as torch's fused kernel
  bool first_step; // torch starts the momentum buffer as a copy of the first gradient
};

struct Sgd : StepTraits {
  static constexpr const char* kOp = "sgd_step_";
  static constexpr const char* kStateLists[] = {"momentum_buffers"};
  using Hyper = SgdHyper;
  using Scalars = SgdScalars;
  // 1 - dampening is formed in double, as torch does, then everything is rounded to fp32 once.
  static Hyper hyper(double momentum, double dampening, double weight_decay, bool nesterov) {
    return {float(momentum), float(1.0 - dampening), float(weight_decay), nesterov, momentum != 0.0};
  }
  // as in torch, no buffer exists without momentum
  static bool uses_state(int, const Hyper& h, bool) { return h.momentum_buffers; }
  // torch's fused SGD rounds its double -lr to fp32 (negation commutes with rounding).
  FA_HD static Scalars scalars(double lr, float step, const Hyper&) { return {float(-lr), step == 1.0f}; }
  static constexpr int kModes = 16;
  FA_HD static int mode(const Hyper& h, const Scalars& s, bool) {
    return (h.weight_decay != 0.0f ? 8 : 0) | (h.momentum != 0.0f ? 4 : 0) | (s.first_step ? 2 : 0) |
           (h.nesterov ? 1 : 0);
  }
  FA_HD static constexpr unsigned reads(int mode) { return (mode & 4) && !(mode & 2) ? 1 : 0; }
  FA_HD static constexpr unsigned writes(int mode) { return (mode & 4) ? 1 : 0; }
  // Updates param (fp32 value) and, when momentum != 0, the momentum buffer:
  //   g += wd * p;  buf = g (first step) or momentum * buf + (1 - dampening) * g;
  //   g = nesterov ? g + momentum * buf : buf;  p -= lr * g
  // each `+` of a product being one FMA, as in torch's fused CPU SGD.
  template <int kMode, class D = Divide>
  FA_HD static void update(float g, float& param, float& buf, float&, float&, const Hyper& h, const Scalars& s,
                           D = D()) {
    constexpr bool kWeightDecay = kMode & 8, kMomentum = kMode & 4, kFirstStep = kMode & 2, kNesterov = kMode & 1;
    if (kWeightDecay) g = fmaf(param, h.weight_decay, g);
    if (kMomentum) {
      buf = kFirstStep ? g : fmaf(g, h.one_minus_dampening, buf * h.momentum);
      g = kNesterov ? fmaf(buf, h.momentum, g) : buf;
    }
    param = fmaf(g, s.neg_lr, param);
  }
  static constexpr int kCudaMinBlocks[] = {6};  // 80 registers (nvcc 13.0, sm_90)
};

// ---- Adam / AdamW (torch.optim.Adam, torch.optim.AdamW, amsgrad or not) ----------------------

struct AdamHyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  bool decoupled;
  // The exact values, for the per-tensor scalars, which torch computes in double.
  double beta1_d, beta2_d, weight_decay_d;
};
struct AdamScalars {
  float neg_step_size;         // -lr / (1 - beta1^step)
  float bias_correction2_sqrt; // sqrt(1 - beta2^step)
  float decay_factor;          // 1 - lr * weight_decay (AdamW), else 1
};

// torch.lerp(a, b, w) as torch computes it (and so its fused Adam's exp_avg.lerp_(grad, 1 - beta1)):
// from the nearer end, one FMA.
FA_HD float lerp(float a, float b, float w) {
  return fabsf(w) < 0.5f ? fmaf(w, b - a, a) : fmaf(w - 1.0f, b - a, b);
}

// max that propagates NaN from either side, as torch.maximum (amsgrad's running max).
FA_HD float max_nan(float a, float b) { return (a > b || a != a) ? a : b; }

struct Adam : StepTraits {
  static constexpr const char* kOp = "adam_step_";
  // a non-empty max_exp_avg_sqs is amsgrad
  static constexpr const char* kStateLists[] = {"exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"};
  using Hyper = AdamHyper;
  using Scalars = AdamScalars;
  static Hyper hyper(double beta1, double beta2, double eps, double weight_decay, bool decoupled) {
    return {float(beta1),        float(beta2), float(1.0 - beta1), float(1.0 - beta2),
            float(eps),          float(weight_decay), decoupled, beta1, beta2, weight_decay};
  }
  static bool uses_state(int k, const Hyper&, bool given) { return k < 2 || given; }
  // In double, rounded to float once, as torch's fused kernel: in fp32, 1 - beta2^step alone is
  // off by up to 6e-8 relative at step 1 and its error grows with the step count (0.999^step in
  // fp32 loses ~log2(step) bits), which made every step differ from torch by ~5e-6 relative.
  FA_HD static Scalars scalars(double lr, float step, const Hyper& h) {
    const double bias_correction1 = 1.0 - pow(h.beta1_d, double(step));
    const double bias_correction2 = 1.0 - pow(h.beta2_d, double(step));
    Scalars s;
    s.neg_step_size = float(-(lr / bias_correction1));
    s.bias_correction2_sqrt = float(sqrt(bias_correction2));
    s.decay_factor = h.decoupled ? float(1.0 - lr * h.weight_decay_d) : 1.0f;
    return s;
  }
  static constexpr int kModes = 16;
  FA_HD static int mode(const Hyper& h, const Scalars&, bool amsgrad) {
    return (h.weight_decay != 0.0f ? 8 : 0) | (h.decoupled ? 4 : 0) |
           (fabsf(h.one_minus_beta1) < 0.5f ? 2 : 0) | (amsgrad ? 1 : 0);
  }
  FA_HD static constexpr unsigned reads(int mode) { return (mode & 1) ? 7 : 3; }
  FA_HD static constexpr unsigned writes(int mode) { return reads(mode); }
  // The update, its mode's bits: kWeightDecay (weight_decay != 0), kDecoupled (AdamW), kLerpFromM
  // (|1 - beta1| < 0.5: which end math::lerp starts from), kAmsgrad (max_v is updated and used).
  //   p *= 1 - lr*wd (AdamW) or g += wd * p (Adam);  m = lerp(m, g, 1 - beta1);
  //   v = beta2 * v + (1 - beta2) * g * g;  max_v = max(max_v, v) (amsgrad);
  //   p -= step_size * m / (sqrt(v or max_v) / sqrt(1 - beta2^step) + eps)
  // with torch's two divides, no reciprocals: our ulp budget against torch is 0, and a multiply
  // by a rounded reciprocal rounds differently for 2-70% of elements in the first divide (by the
  // bias correction; the share depends on the step) and 27% in the second (measured on random
  // fp32 data). The divide by the bias correction is divide_bc2's (a Divide, or an exact
  // replacement: csrc/cpu/kernels.cpp's DivideByConstant).
  template <int kMode, class D = Divide>
  FA_HD static void update(float g, float& param, float& exp_avg, float& exp_avg_sq, float& max_exp_avg_sq,
                           const Hyper& h, const Scalars& s, D divide_bc2 = D()) {
    constexpr bool kWeightDecay = kMode & 8, kDecoupled = kMode & 4, kLerpFromM = kMode & 2, kAmsgrad = kMode & 1;
    float p = param;
    if (kWeightDecay) {
      if (kDecoupled) p = p * s.decay_factor;
      else g = fmaf(p, h.weight_decay, g);
    }
    const float w = h.one_minus_beta1;
    exp_avg = kLerpFromM ? fmaf(w, g - exp_avg, exp_avg) : fmaf(w - 1.0f, g - exp_avg, g);
    exp_avg_sq = fmaf(g * h.one_minus_beta2, g, exp_avg_sq * h.beta2);
    float v = exp_avg_sq;
    if (kAmsgrad) v = max_exp_avg_sq = max_nan(max_exp_avg_sq, v);
    const float denom = divide_bc2(sqrtf(v), s.bias_correction2_sqrt) + h.eps;
    param = p + (s.neg_step_size * exp_avg) / denom;
  }
  FA_HD static float divisor(const Scalars& s) { return s.bias_correction2_sqrt; }
  static constexpr int kCudaMinBlocks[] = {5, 4};  // 94, and 109-119 registers with amsgrad
};

// ---- Lion (Chen et al. 2023), decoupled weight decay ------------------------------------------

// As lucidrains/lion-pytorch writes it with torch ops (whose add(alpha=) is one FMA on the CPU):
//   update = sign(beta1 * m + (1 - beta1) * g);  p = p * (1 - lr * wd) - lr * update;
//   m = beta2 * m + (1 - beta2) * g   (after the update: the sign uses the old m)
struct LionHyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, weight_decay;
  double weight_decay_d;  // for the decay factor, formed in double from Python floats
};
struct LionScalars {
  float lr;
  float decay_factor; // 1 - lr * weight_decay
};

// torch.sign: -1, 0 or +1 (0 for 0, which copysign would not give).
FA_HD float sign(float x) { return (x > 0.0f ? 1.0f : 0.0f) - (x < 0.0f ? 1.0f : 0.0f); }

struct Lion : StepTraits {
  static constexpr const char* kOp = "lion_step_";
  static constexpr const char* kStateLists[] = {"exp_avgs"};
  using Hyper = LionHyper;
  using Scalars = LionScalars;
  static Hyper hyper(double beta1, double beta2, double weight_decay) {
    return {float(beta1),       float(beta2), float(1.0 - beta1),
            float(1.0 - beta2), float(weight_decay), weight_decay};
  }
  static bool uses_state(int, const Hyper&, bool) { return true; }
  // From the double lr, as lucidrains' torch ops take a Python float lr: p.add_(update, alpha=-lr)
  // rounds it to fp32, p.mul_(1 - lr * wd) forms the factor in double.
  FA_HD static Scalars scalars(double lr, float, const Hyper& h) {
    return {float(lr), float(1.0 - lr * h.weight_decay_d)};
  }
  static constexpr int kModes = 1;
  FA_HD static int mode(const Hyper&, const Scalars&, bool) { return 0; }
  FA_HD static constexpr unsigned reads(int) { return 1; }
  FA_HD static constexpr unsigned writes(int) { return 1; }
  template <int kMode, class D = Divide>
  FA_HD static void update(float g, float& param, float& exp_avg, float&, float&, const Hyper& h, const Scalars& s,
                           D = D()) {
    const float decayed = param * s.decay_factor;
    const float direction = sign(fmaf(g, h.one_minus_beta1, exp_avg * h.beta1));
    param = decayed - s.lr * direction;  // direction is -1, 0 or 1: the product is exact
    exp_avg = fmaf(g, h.one_minus_beta2, exp_avg * h.beta2);
  }
  static constexpr int kCudaMinBlocks[] = {6};  // 80 registers
};

// ---- Adagrad (torch.optim.Adagrad) -----------------------------------------------------------------

struct AdagradHyper {
  float weight_decay, eps;
  double lr_decay_d;  // for clr, which torch forms in double
};
struct AdagradScalars {
  float clr;  // lr / (1 + (step - 1) * lr_decay)
};

struct Adagrad : StepTraits {
  static constexpr const char* kOp = "adagrad_step_";
  static constexpr const char* kStateLists[] = {"sums"};
  using Hyper = AdagradHyper;
  using Scalars = AdagradScalars;
  static Hyper hyper(double lr_decay, double weight_decay, double eps) {
    return {float(weight_decay), float(eps), lr_decay};
  }
  static bool uses_state(int, const Hyper&, bool) { return true; }
  // In double from the double lr, rounded to fp32 once, as torch's fused kernel.
  FA_HD static Scalars scalars(double lr, float step, const Hyper& h) {
    return {float(lr / (1.0 + (double(step) - 1.0) * h.lr_decay_d))};
  }
  static constexpr int kModes = 2;
  FA_HD static int mode(const Hyper& h, const Scalars&, bool) { return h.weight_decay != 0.0f ? 1 : 0; }
  FA_HD static constexpr unsigned reads(int) { return 1; }
  FA_HD static constexpr unsigned writes(int) { return 1; }
  // As torch's fused CPU Adagrad (its `a += b * c` contracted into FMAs, as probing it shows):
  //   g += wd * p;  sum += g * g;  p -= clr * g / (sqrt(sum) + eps)
  template <int kMode, class D = Divide>
  FA_HD static void update(float g, float& param, float& sum, float&, float&, const Hyper& h, const Scalars& s,
                           D = D()) {
    if (kMode & 1) g = fmaf(param, h.weight_decay, g);
    sum = fmaf(g, g, sum);
    param = param - (s.clr * g) / (sqrtf(sum) + h.eps);
  }
  static constexpr int kCudaMinBlocks[] = {5};  // 6 (80 registers): 8 bytes spilled without remainders (nvcc 13.0, sm_80 and sm_90)
};

// ---- AdEMAMix (Pagliardini et al. 2024), decoupled weight decay ------------------------------------

// As pytorch-optimizer 4.1.0's AdEMAMix(weight_decouple=True) computes it with torch ops on the CPU
// (fused_accum/backends/reference.py: ademamix_step, its orders and FMAs):
//   p *= 1 - lr * wd;  m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g;
//   m_slow = lerp(m_slow, g, 1 - beta3_t);
//   p += -lr * (m / (1 - beta1^step) + alpha_t * m_slow) / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// with alpha_t and beta3_t warmed up over t_alpha_beta3 steps where it is given (scalars()).
struct AdemamixHyper {
  float beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  // the exact values, for the per-tensor scalars, which pytorch-optimizer computes in double
  double beta1_d, beta2_d, beta3_d, alpha_d, weight_decay_d;
  bool warmup;  // t_alpha_beta3 is given
  double t_d, log_beta1_d, log_beta3_d;
};
struct AdemamixScalars {
  float neg_lr;                // -lr (torch's addcdiv_(value=-lr) rounds it to fp32)
  float decay_factor;          // 1 - lr * weight_decay
  float bias_correction1;      // 1 - beta1^step
  float bias_correction2_sqrt; // sqrt(1 - beta2^step)
  float alpha;                 // alpha_t
  float one_minus_beta3;       // 1 - beta3_t: the slow EMA's lerp weight
};

struct Ademamix : StepTraits {
  static constexpr const char* kOp = "ademamix_step_";
  static constexpr const char* kStateLists[] = {"exp_avgs", "exp_avg_sqs", "exp_avg_slows"};
  using Hyper = AdemamixHyper;
  using Scalars = AdemamixScalars;
  static Hyper hyper(double beta1, double beta2, double beta3, double alpha, std::optional<double> t_alpha_beta3,
                     double eps, double weight_decay) {
    Hyper h{float(beta2), float(1.0 - beta1), float(1.0 - beta2), float(eps), float(weight_decay),
            beta1, beta2, beta3, alpha, weight_decay, t_alpha_beta3.has_value(), 0.0, 0.0, 0.0};
    // the logs once, on the host, as pytorch-optimizer's math.log (the registry refuses a warm-up
    // with beta1 or beta3 at 0)
    if (h.warmup) {
      h.t_d = *t_alpha_beta3;
      h.log_beta1_d = log(beta1);
      h.log_beta3_d = log(beta3);
    }
    return h;
  }
  static bool uses_state(int, const Hyper&, bool) { return true; }
  // In double, each rounded to fp32 where the peer's op takes its Python float:
  //   alpha_t = min(step * alpha / T, alpha),
  //   beta3_t = min(exp(ln b1 ln b3 / ((1 - step / T) ln b3 + (step / T) ln b1)), b3)
  // (min(x, y) as Python's: x unless y < x).
  FA_HD static Scalars scalars(double lr, float step, const Hyper& h) {
    const double s = step;
    double alpha = h.alpha_d, beta3 = h.beta3_d;
    if (h.warmup) {
      const double a = s * h.alpha_d / h.t_d, ratio = s / h.t_d;
      const double b = exp(h.log_beta1_d * h.log_beta3_d / ((1.0 - ratio) * h.log_beta3_d + ratio * h.log_beta1_d));
      alpha = h.alpha_d < a ? h.alpha_d : a;
      beta3 = h.beta3_d < b ? h.beta3_d : b;
    }
    Scalars sc;
    sc.neg_lr = float(-lr);
    sc.decay_factor = float(1.0 - lr * h.weight_decay_d);
    sc.bias_correction1 = float(1.0 - pow(h.beta1_d, s));
    sc.bias_correction2_sqrt = float(sqrt(1.0 - pow(h.beta2_d, s)));
    sc.alpha = float(alpha);
    sc.one_minus_beta3 = float(1.0 - beta3);
    return sc;
  }
  // kWeightDecay, and which end each lerp starts from (math::lerp): m's (|1 - beta1| < 0.5) and
  // the slow EMA's (|1 - beta3_t| < 0.5, per tensor: beta3_t moves with the step count)
  static constexpr int kModes = 8;
  FA_HD static int mode(const Hyper& h, const Scalars& s, bool) {
    return (h.weight_decay != 0.0f ? 4 : 0) | (fabsf(h.one_minus_beta1) < 0.5f ? 2 : 0) |
           (fabsf(s.one_minus_beta3) < 0.5f ? 1 : 0);
  }
  FA_HD static constexpr unsigned reads(int) { return 7; }
  FA_HD static constexpr unsigned writes(int) { return 7; }
  template <int kMode, class D = Divide>
  FA_HD static void update(float g, float& param, float& exp_avg, float& exp_avg_sq, float& exp_avg_slow,
                           const Hyper& h, const Scalars& s, D = D()) {
    constexpr bool kWeightDecay = kMode & 4, kLerpFromM = kMode & 2, kSlowLerpFromM = kMode & 1;
    float p = param;
    if (kWeightDecay) p = p * s.decay_factor;
    const float w = h.one_minus_beta1, w3 = s.one_minus_beta3;
    exp_avg = kLerpFromM ? fmaf(w, g - exp_avg, exp_avg) : fmaf(w - 1.0f, g - exp_avg, g);
    exp_avg_sq = fmaf(g * h.one_minus_beta2, g, exp_avg_sq * h.beta2);
    exp_avg_slow = kSlowLerpFromM ? fmaf(w3, g - exp_avg_slow, exp_avg_slow) : fmaf(w3 - 1.0f, g - exp_avg_slow, g);
    const float denom = sqrtf(exp_avg_sq) / s.bias_correction2_sqrt + h.eps;
    const float update = fmaf(exp_avg_slow, s.alpha, exp_avg / s.bias_correction1);
    param = p + (s.neg_lr * update) / denom;
  }
  static constexpr int kCudaMinBlocks[] = {4};  // one kernel: its third state list is required
};

// ---- Muon (torch.optim.Muon): a split step's two elementwise ops ---------------------------------

// Its step is the prologue, torch's Newton-Schulz orthogonalization of each matrix (torch
// matmuls, between the two ops: fused_accum/muon.py) and the epilogue, each as
// fused_accum/backends/reference.py's muon_prologue and muon_epilogue compute it with torch ops.
struct MuonHyper {
  float momentum, one_minus_momentum;  // torch.lerp's weights, rounded to fp32 as torch's
  bool nesterov, match_rms_adamw;
  double weight_decay_d;  // for the epilogue's decay factor, formed in double
};
inline MuonHyper muon_hyper(double momentum, bool nesterov, double weight_decay, bool match_rms_adamw) {
  return {float(momentum), float(1.0 - momentum), nesterov, match_rms_adamw, weight_decay};
}

// The prologue: buf = lerp(buf, g, 1 - momentum); the middle's input (state 2, written, never
// read) = nesterov ? lerp(g, buf, momentum) : buf. No parameter is read or written.
struct MuonPrologue : StepTraits {
  static constexpr const char* kOp = "muon_prologue_";
  static constexpr const char* kStateLists[] = {"momentum_buffers", "updates"};
  static constexpr bool kWritesParam = false, kMaximize = false;
  using Hyper = MuonHyper;
  struct Scalars {};
  // (ns_* and eps are the middle's)
  static Hyper hyper(double momentum, bool nesterov, double weight_decay, double, double, double, double, double,
                     bool match_rms_adamw) {
    return muon_hyper(momentum, nesterov, weight_decay, match_rms_adamw);
  }
  static bool uses_state(int, const Hyper&, bool) { return true; }
  FA_HD static Scalars scalars(double, float, const Hyper&) { return {}; }
  // nesterov, and which end each lerp starts from (math::lerp): the buffer's (|1 - momentum| <
  // 0.5) and nesterov's (|momentum| < 0.5)
  static constexpr int kModes = 8;
  FA_HD static int mode(const Hyper& h, const Scalars&, bool) {
    return (fabsf(h.momentum) < 0.5f ? 4 : 0) | (fabsf(h.one_minus_momentum) < 0.5f ? 2 : 0) | (h.nesterov ? 1 : 0);
  }
  FA_HD static constexpr unsigned reads(int) { return 1; }
  FA_HD static constexpr unsigned writes(int) { return 3; }
  template <int kMode, class D = Divide>
  FA_HD static void update(float g, float&, float& buf, float& input, float&, const Hyper& h, const Scalars&,
                           D = D()) {
    constexpr bool kNesterovFromG = kMode & 4, kLerpFromBuf = kMode & 2, kNesterov = kMode & 1;
    const float w = h.one_minus_momentum, m = h.momentum;
    buf = kLerpFromBuf ? fmaf(w, g - buf, buf) : fmaf(w - 1.0f, g - buf, g);
    if (kNesterov) input = kNesterovFromG ? fmaf(m, buf - g, g) : fmaf(m - 1.0f, buf - g, buf);
    else input = buf;
  }
  static constexpr int kCudaMinBlocks[] = {6};
};

// The epilogue: p = (p * (1 - lr * weight_decay)) + u * (-lr * ratio), one FMA (torch's
// add_(alpha=)), u the middle's output (the input, read in the gradient's place), ratio of the
// matrix's (rows, columns): sqrt(max(1, rows / columns)), or 0.2 sqrt(max(rows, columns)) with
// match_rms_adamw; each factor formed in double and rounded to fp32 once.
struct MuonEpilogue : StepTraits {
  static constexpr const char* kOp = "muon_epilogue_";
  static constexpr const char* kStateLists[] = {"updates"};
  static constexpr bool kReadsInput = true, kShaped = true, kMaximize = false;
  using Hyper = MuonHyper;
  struct Scalars {
    float decay_factor;  // 1 - lr * weight_decay
    float neg_lr;        // -(lr * ratio)
  };
  static Hyper hyper(double momentum, bool nesterov, double weight_decay, double a, double b, double c, double eps,
                     double steps, bool match_rms_adamw) {
    return MuonPrologue::hyper(momentum, nesterov, weight_decay, a, b, c, eps, steps, match_rms_adamw);
  }
  // (its list is its input: none is a state the kernels read or write as one)
  static bool uses_state(int, const Hyper&, bool) { return false; }
  FA_HD static Scalars scalars(double lr, float, const Hyper& h, int64_t rows, int64_t columns) {
    const double larger = double(rows > columns ? rows : columns);
    const double tall = double(rows) / double(columns);
    const double ratio = h.match_rms_adamw ? 0.2 * sqrt(larger) : sqrt(tall > 1.0 ? tall : 1.0);
    return {float(1.0 - lr * h.weight_decay_d), float(-(lr * ratio))};
  }
  static constexpr int kModes = 1;
  FA_HD static int mode(const Hyper&, const Scalars&, bool) { return 0; }
  FA_HD static constexpr unsigned reads(int) { return 0; }
  FA_HD static constexpr unsigned writes(int) { return 0; }
  template <int kMode, class D = Divide>
  FA_HD static void update(float u, float& param, float&, float&, float&, const Hyper&, const Scalars& s, D = D()) {
    param = fmaf(u, s.neg_lr, param * s.decay_factor);
  }
  static constexpr int kCudaMinBlocks[] = {6};
};

// Algo's per-tensor scalars for a tensor of `numel` elements, `rows` of them (a kShaped
// algorithm's matrix; else unused): the kernels' one call of scalars().
template <class Algo>
FA_HD typename Algo::Scalars tensor_scalars(double lr, float step, const typename Algo::Hyper& h, int64_t rows,
                                            int64_t numel) {
  if constexpr (Algo::kShaped) return Algo::scalars(lr, step, h, rows, numel / rows);
  else return Algo::scalars(lr, step, h);
}

// ---- any algorithm, its mode picked at run time -------------------------------------------------

// A mode as a type: Mode<k>::value.
template <int k>
struct Mode {
  static constexpr int value = k;
};

// f(Mode<mode>{}), mode in [0, Algo::kModes): a chain of compares, run once per call (the CPU:
// once per block; CUDA: per element, uniform over the grid). kState3: whether the modes that use
// a third state list are instantiated (CUDA's kernels without the seventh operand have none).
template <class Algo, bool kState3 = true, int kMode = 0, class F>
FA_HD_ALWAYS_INLINE void with_mode(int mode, F&& f) {
  if constexpr (kMode < Algo::kModes) {
    if constexpr (!kState3 && ((Algo::reads(kMode) | Algo::writes(kMode)) & 4u) != 0) {
      with_mode<Algo, kState3, kMode + 1>(mode, f);
    } else if (mode == kMode) {
      f(Mode<kMode>{});
    } else {
      with_mode<Algo, kState3, kMode + 1>(mode, f);
    }
  }
}

// One element's update, the mode picked from (h, s, state3) at run time: the CUDA kernels'
// element loop and the tests' per-element expectations.
template <class Algo, bool kState3 = true>
FA_HD void update(float g, float& p, float& s1, float& s2, float& s3, bool state3, const typename Algo::Hyper& h,
                  const typename Algo::Scalars& s) {
  with_mode<Algo, kState3>(Algo::mode(h, s, kState3 && state3), [&](auto k) {
    Algo::template update<decltype(k)::value>(g, p, s1, s2, s3, h, s);
  });
}

// ---- exact 2-byte masters: a bf16 weight plus a 16-bit remainder --------------------------------

// master_weights="remainder" keeps a bf16 parameter's fp32 master as the parameter itself (its
// high half, rounded) plus an int16 remainder, split and rebuilt here, in the step.
// fused_accum/backends/reference.py (split_master, rebuild_master) is the same map in PyTorch;
// docs/masters.md says which patterns show how.
//
// The split, on the magnitude m of the master's bits (the sign bit is the weight's):
//   - m < 0x7F7F8000 (every finite master below 3.3961e38): weight W = (m + 0x8000) >> 16, the
//     nearest bf16 with ties away from zero (no remainder rule can keep torch's ties-to-even: an
//     even bf16 value has 65,537 fp32 preimages), remainder r = m - (W << 16), in
//     [-32768, 32767]. Exact round trip.
//   - 0x7F7F8000 <= m <= 0x7F800000 (finite masters that round to inf in bf16, and inf):
//     (+-inf, 0): they become +-inf, as master.to(torch.bfloat16) would show them.
//   - m > 0x7F800000 (NaN): (+-NaN: the bf16 pattern 0x7FC0 with the sign, remainder 0): a NaN
//     stays a NaN (its payload is not kept).
// The rebuild of any pair (W = the weight's magnitude bits, r the remainder):
//   - W == 0 and r < 0: +-0.0 (the weight itself);
//   - W == 0x7F80 (inf) and r != 0: +-inf (the weight itself);
//   - otherwise sign | ((W << 16) + r) (a NaN weight with any remainder rebuilds to a NaN).
// So every pair rebuilds to a master that rounds to its weight under the tie rule (the split of
// the rebuild gives the weight back, NaN weights as the canonical NaN), within half a bf16 ulp
// of it: a remainder left under a weight written from outside the optimizer moves the master by
// less than half an ulp of the new weight, and never to a huge value or a NaN. (The map was a
// bijection with two swaps before; (+-0, r < 0) then rebuilt to finite masters >= 3.3961e38,
// and pruning, w.data[mask] = 0 over a negative remainder, gave a NaN loss two steps later.)
// csrc/tests/test_math.cpp checks these properties on all 2^32 patterns and all 2^32 pairs.
FA_HD_ALWAYS_INLINE unsigned int float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  unsigned int u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FA_HD_ALWAYS_INLINE float bits_float(unsigned int u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

struct SplitMaster {
  unsigned short weight;  // the bf16 bits
  short remainder;
};

constexpr unsigned int kOverflowing = 0x7F7F8000u;  // magnitudes from here to inf round to inf
constexpr unsigned int kInfBits = 0x7F800000u;      // the magnitude of inf

// Computed on the two halves in 16-bit arithmetic, which is the map above: the remainder is the
// low half read as a signed number (m - (W << 16) lies in [-32768, 32767] and equals m modulo
// 2^16), and the weight's magnitude is the high half's plus one where that number is negative
// (the low half >= 0x8000: round up, ties away from zero). The CPU loops then run the selects on
// 32 lanes per AVX-512 register, half the time of the same map on 32-bit lanes (measured: split
// 0.15 -> 0.08 ns, rebuild 0.18 -> 0.13 ns per element, AVX-512; AVX2 2x too).
//
// The selects are written as masks (all ones or zeros), not ?: or &&: the CPU's fused update
// loops (csrc/cpu/kernels.cpp) carry these inline, and with ?: GCC 13 left 15 of the 16 Adam
// loops unvectorised ("control flow in loop"). Magnitude halves are at most 0x7FFF, so they are
// compared as signed shorts (AVX2 has no unsigned 16-bit compare).
FA_HD_ALWAYS_INLINE unsigned short mask_if(bool c) { return static_cast<unsigned short>(-static_cast<int>(c)); }

FA_HD_ALWAYS_INLINE SplitMaster split_master(float master) {
  const unsigned int u = float_bits(master);
  const unsigned short high = static_cast<unsigned short>(u >> 16);
  const short r = static_cast<short>(static_cast<unsigned short>(u));
  const short h = static_cast<short>(high & 0x7FFFu);
  const unsigned short up = mask_if(r < 0);  // round the magnitude up
  // rounding up from 0x7F7F: a finite master that rounds to inf (its weight, 0x7F80, is inf
  // already; the remainder goes); above 0x7F80, or 0x7F80 with a low half: a NaN
  const unsigned short overflowing = up & mask_if(h == 0x7F7F);
  const unsigned short nan = mask_if(h > 0x7F80) | (mask_if(h == 0x7F80) & mask_if(r != 0));
  const unsigned short w = static_cast<unsigned short>(h - up);  // h + 1 where up
  const unsigned short shown = (w & static_cast<unsigned short>(~nan)) | (0x7FC0u & nan);
  const short rem = static_cast<short>(static_cast<unsigned short>(r) & static_cast<unsigned short>(~(overflowing | nan)));
  return {static_cast<unsigned short>((high & 0x8000u) | shown), rem};
}

FA_HD_ALWAYS_INLINE float rebuild_master(unsigned short weight, short remainder) {
  const short w0 = static_cast<short>(weight & 0x7FFFu);
  const unsigned short negative = mask_if(remainder < 0);
  // the weight itself: +-0 under a negative remainder, +-inf under any but 0
  const unsigned short keep = (negative & mask_if(w0 == 0)) | (mask_if(w0 == 0x7F80) & mask_if(remainder != 0));
  // (W << 16) + remainder: the high half is W, less one where the remainder is negative
  const unsigned short moved = (weight & 0x8000u) | static_cast<unsigned short>(w0 + negative);
  const unsigned short high = (weight & keep) | (moved & static_cast<unsigned short>(~keep));
  const unsigned short low = static_cast<unsigned short>(remainder) & static_cast<unsigned short>(~keep);
  return bits_float(static_cast<unsigned int>(high) << 16 | low);
}

// ---- fp32 masters follow the weight, element by element ---------------------------------------

// When a step has low-precision params (lp_params: the bf16/fp16 weights whose fp32 masters it
// updates), each element's master is first taken as float(lp) where the lp element's bits
// differ from the bits of the master rounded to lp's dtype (the rounding the step writes lp
// with: round to nearest even), else the master as it is; the update runs from that value.
// Values decide, not version counters: a weight written from outside the optimizer
// (p.data[mask] = 0, dist.broadcast(p), an EMA swap) moves no counter reliably, and a stale
// master would write its old value back over the user's. Only elements whose weight no longer
// equals the master's rounding restart: a write that changes nothing keeps the master's full
// precision. Bits, not values: a NaN master whose rounding equals the stored NaN bits is kept,
// and -0.0 against +0.0 counts as a difference. `rounded` is the master's rounding to lp's
// dtype and `lp_bits` the stored ones (each zero-extended), `lp` the stored value widened.
// A bit select (no ?:), so that the CPU loop vectorises and a NaN's payload is kept as it is.
FA_HD_ALWAYS_INLINE float follow_weight(float master, unsigned int rounded, unsigned int lp_bits, float lp) {
  const unsigned int differ = 0u - static_cast<unsigned int>(rounded != lp_bits);
  return bits_float((float_bits(lp) & differ) | (float_bits(master) & ~differ));
}

}  // namespace math
}  // namespace fused_accum
