// One optimizer-step test case for the standalone kernel tests (CPU kernels, and the CUDA kernels
// emulated on the CPU): inputs for an update rule, a param kind and a fused mode, and the check of
// every output element against a plain per-element loop over the math.h rules. Every algorithm of
// math.h's FUSED_ACCUM_ALGORITHMS runs, its hyper-parameters made from its hyper()'s signature
// (hyper_case below).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "../math.h"
#include "check.h"
#include "data.h"

namespace fa_test {

using namespace fused_accum;

// fp32 master + bf16/fp16 copy; fp32; bf16, no master; bf16 + int16 remainder (an exact master)
enum class ParamKind { kMaster, kF32, kBF16, kRemainder };
enum class Fused { kNone, kAdd, kOverwrite };

// An algorithm's hyper-parameters for a case: its k-th float argument kHyperValues[k], every
// bool true and every optional float (the schema's float?) kHyperValues[k] too, or (zeros) every
// float 0, every bool false and every optional float absent (None), so that the branches the kernels take
// as template constants (math.h's modes: a momentum, a weight decay, a flag on or off) run both
// ways. SGD's (momentum, dampening, weight_decay, nesterov), for example: momentum SGD with
// weight decay and nesterov, and plain SGD; Adam's (beta1, beta2, eps, weight_decay, decoupled):
// AdamW with weight decay and m lerped from its end (|1 - beta1| < 0.5), and Adam with beta1 =
// beta2 = eps = 0 (lerped from g).
constexpr double kHyperValues[] = {0.8, 0.99, 1e-6, 0.1, 0.5, 0.3, 0.7, 0.2, 0.9};

template <class T>
T hyper_value(size_t k, bool zeros) {
  if constexpr (std::is_same_v<T, bool>) return !zeros;
  else if constexpr (std::is_same_v<T, std::optional<double>>) return zeros ? std::nullopt : T(kHyperValues[k]);
  else return zeros ? 0.0 : kHyperValues[k];
}
template <class Algo, class... H, size_t... k>
typename Algo::Hyper hyper_case(typename Algo::Hyper (*hyper)(H...), bool zeros, std::index_sequence<k...>) {
  static_assert(sizeof...(H) <= sizeof(kHyperValues) / sizeof(double), "kHyperValues: a value per argument");
  return hyper(hyper_value<H>(k, zeros)...);
}
template <class Algo, class... H>
typename Algo::Hyper hyper_case(typename Algo::Hyper (*hyper)(H...), bool zeros) {
  return hyper_case<Algo>(hyper, zeros, std::index_sequence_for<H...>{});
}

// Bit-identical: the kernels and this per-element loop run the same math.h code, every FMA
// explicit and nothing else contracted (-ffp-contract=off), so no rounding may differ, whatever
// SIMD clone runs.
inline bool same(float got, float want) { return got == want || (got != got && want != want); }

// runner(lists, args) calls the kernel under test; rule(g, p, s1, s2, s3, i) is the update of one
// element of tensor i, as the algorithm's math.h rule computes it.
using StepRunner = std::function<void(const TensorLists&, const StepArgs&)>;
using StepRule = std::function<void(float, float&, float&, float&, float&, size_t)>;

struct StepCase {
  std::vector<int64_t> sizes;
  std::string algo;     // for messages
  bool uses[3];         // which state lists the case has (state1..state3)
  ParamKind kind;
  Fused fused;
  bool found;
  std::mt19937 rng;
  Flat acc, master, s1, s2, s3;
  Mixed param16, grad, lp;
  // kRemainder: int16 remainders, uniform over all 2^16 patterns (negative ones included, with
  // the swaps), every fourth tensor starting one element in (another tensor than param16's)
  std::vector<std::vector<int16_t>> rem;
  std::vector<int> rem_shift;
  std::vector<float> steps;
  double lr = 0.01;  // a double, as the kernels take it; not exact in fp32
  float coef = 0.25f, found_inf, grad_alpha = 0.5f;
  // the algorithm's form (math.h's StepTraits; as_of<Algo>() sets them): a step that writes no
  // param keeps every param, lp and remainder bit; one that reads an input reads it in the
  // gradient's place (`grad`, whatever `fused`), as it is; a shaped one takes `rows`
  bool writes_param = true, reads_input = false;
  std::vector<int64_t> rows;

  template <class Algo>
  StepCase& as_of() {
    writes_param = Algo::kWritesParam;
    reads_input = Algo::kReadsInput;
    rows.clear();
    // a tall and a wide matrix in turn: its smallest divisor above 1 as its columns or rows
    for (size_t i = 0; Algo::kShaped && i < sizes.size(); ++i) {
      int64_t d = 2;
      while (d < sizes[i] && sizes[i] % d != 0) ++d;
      if (d > sizes[i]) d = 1;
      rows.push_back(i % 2 ? d : sizes[i] / d);
    }
    return *this;
  }

  StepCase(std::vector<int64_t> sizes_, std::string a, const bool* uses_, ParamKind k, Fused f, bool found_,
           unsigned seed)
      : sizes(sizes_), algo(a), uses{uses_[0], uses_[1], uses_[2]}, kind(k), fused(f), found(found_), rng(seed), acc(sizes, rng),
        master(sizes, rng), s1(sizes, rng, true), s2(sizes, rng, true), s3(sizes, rng, true),
        param16(sizes, rng, {DType::kBF16}), grad(sizes, rng), lp(sizes, rng, {DType::kBF16, DType::kF16}),
        found_inf(found_ ? 1.0f : 0.0f) {
    for (size_t i = 0; i < sizes.size(); ++i) steps.push_back(1.0f + (i % 3) * 4);  // incl. first steps
    std::uniform_int_distribution<int> any16(-32768, 32767);
    for (size_t i = 0; i < sizes.size(); ++i) {
      rem_shift.push_back(i % 4 == 1 ? 1 : 0);
      rem.emplace_back(sizes[i] + 1);
      for (int16_t& r : rem.back()) r = static_cast<int16_t>(any16(rng));
    }
    // kRemainder: some weights written from outside over their remainders: +-0 (pruned), +-inf,
    // and a NaN, whose pairs rebuild to the weight itself (or a NaN)
    const uint16_t outside[] = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0};
    for (size_t i = 0; i < sizes.size() && kind == ParamKind::kRemainder; ++i)
      for (int64_t j = 0; j < sizes[i]; j += 13) param16.half[i][j + param16.shift[i]] = outside[(j / 13) % 5];
    // kMaster: the low-precision params are their masters' rounding but where written from
    // outside (the master then follows the weight): a quarter of the elements keep the random
    // value they were drawn with; some hold -0.0 over a +0.0 master, a NaN or an inf
    std::uniform_int_distribution<int> quarter(0, 3);
    for (size_t i = 0; i < sizes.size() && kind == ParamKind::kMaster; ++i) {
      const bool bf16 = lp.dtype(i) == DType::kBF16;
      for (int64_t j = 0; j < sizes[i]; ++j) {
        uint16_t& bits = lp.half[i][j + lp.shift[i]];
        if (j % 17 == 5) {
          master.at(i)[j] = 0.0f;
          bits = 0x8000;  // -0.0
        } else if (j % 17 == 9) {
          bits = bf16 ? 0x7FC0 : 0x7E00;  // NaN
        } else if (j % 17 == 11) {
          bits = bf16 ? 0xFF80 : 0xFC00;  // -inf
        } else if (quarter(rng) != 0) {
          bits = bf16 ? cpu::float_to_bf16(master.value(i, j)) : cpu::float_to_f16(master.value(i, j));
        }
      }
    }
  }

  // The master a step updates (kMaster): the fp32 master, following the low-precision param
  // where that is not its rounding (math::follow_weight, with the CPU's rounding: the values here
  // are no NaNs, where the CUDA rounding differs)
  float followed(size_t i, int64_t j) const {
    const float m = master.value(i, j);
    const uint16_t bits = lp.half[i][j + lp.shift[i]];
    const bool bf16 = lp.dtype(i) == DType::kBF16;
    return math::follow_weight(m, bf16 ? cpu::float_to_bf16(m) : cpu::float_to_f16(m), bits, lp.value(i, j));
  }

  uint16_t weight_bits(size_t i, int64_t j) const { return param16.half[i][j + param16.shift[i]]; }
  int16_t remainder(size_t i, int64_t j) const { return rem[i][j + rem_shift[i]]; }
  float rebuilt(size_t i, int64_t j) const {
    return math::rebuild_master(weight_bits(i, j), remainder(i, j));
  }

  bool has_state1() const { return uses[0]; }
  bool has_state2() const { return uses[1]; }
  bool has_state3() const { return uses[2]; }

  TensorLists lists() {
    TensorLists t;
    for (size_t i = 0; i < sizes.size(); ++i) {
      t.numel.push_back(sizes[i]);
      t.index.push_back(static_cast<int64_t>(i));
      t.acc.add(acc.at(i), DType::kF32);
      if (!writes_param) {  // (the binding hands such a step no param)
      } else if (kind == ParamKind::kBF16 || kind == ParamKind::kRemainder) {
        t.param.add(param16.ptr(i), DType::kBF16);
      } else {
        t.param.add(master.at(i), DType::kF32);
      }
      if (kind == ParamKind::kRemainder && writes_param) t.rem.add(rem[i].data() + rem_shift[i], DType::kI16);
      if (has_state1()) t.state1.add(s1.at(i), DType::kF32);
      if (has_state2()) t.state2.add(s2.at(i), DType::kF32);
      if (has_state3()) t.state3.add(s3.at(i), DType::kF32);
      if (kind == ParamKind::kMaster && writes_param) t.lp.add(lp.ptr(i), lp.dtype(i));
      if (fused != Fused::kNone || reads_input) t.grad.add(grad.ptr(i), grad.dtype(i));
    }
    t.rows = rows;
    return t;
  }

  // Runs the kernel, then checks every element of every output against the math.h rules.
  void run_and_check(const StepRunner& runner, const StepRule& rule, const char* what) {
    const StepCase before = *this;
    const StepArgs args{&lr, &coef, steps.data(), &found_inf, grad_alpha, fused == Fused::kOverwrite, false};
    runner(lists(), args);
    const math::GradScalars gs{coef, grad_alpha, fused != Fused::kNone, fused == Fused::kOverwrite, false};
    int bad = 0;
    const bool kept = found || !writes_param;  // every param, lp and remainder bit as it was
    for (size_t i = 0; i < sizes.size() && bad < 5; ++i) {
      for (int64_t j = 0; j < sizes[i] && bad < 5; ++j) {
        float p = kind == ParamKind::kBF16 ? before.param16.value(i, j) : before.master.value(i, j);
        if (kind == ParamKind::kRemainder) p = before.rebuilt(i, j);
        if (kind == ParamKind::kMaster && !kept) p = before.followed(i, j);  // (kept: as it was)
        float m = before.s1.value(i, j), v = before.s2.value(i, j), max_v = before.s3.value(i, j);
        if (!found) {
          const float g = reads_input ? before.grad.value(i, j)
                                      : math::effective_grad(before.acc.value(i, j),
                                                             fused != Fused::kNone ? before.grad.value(i, j) : 0.0f, gs);
          const float p0 = p;
          rule(g, p, m, v, max_v, i);
          if (!writes_param) p = p0;
        }
        bool ok = true;
        if (kind == ParamKind::kRemainder) {
          // The exact master: split as math::split_master splits the update's, so the rebuilt
          // new one is the update's bit for bit where that is finite below 3.3961e38 (+-inf
          // above, the canonical NaN for a NaN); a skipped step writes neither half.
          const math::SplitMaster want =
              kept ? math::SplitMaster{before.weight_bits(i, j), before.remainder(i, j)}
                   : math::split_master(p);
          ok &= weight_bits(i, j) == want.weight && remainder(i, j) == want.remainder;
          if (!kept) ok &= math::float_bits(rebuilt(i, j)) == math::float_bits(math::rebuild_master(want.weight, want.remainder));
          const uint32_t m = math::float_bits(p) & 0x7FFFFFFFu;
          if (!kept && m < math::kOverflowing) ok &= math::float_bits(rebuilt(i, j)) == math::float_bits(p);
        } else if (kind == ParamKind::kBF16) {
          // Within one bf16 ulp (2^-7 relative): a 1-ulp fp32 difference may cross a rounding edge.
          ok &= kept ? param16.value(i, j) == before.param16.value(i, j)
                      : std::fabs(param16.value(i, j) - p) <= 0.0079f * std::fabs(p);
        } else {
          ok &= same(master.value(i, j), p);
        }
        if (has_state1()) ok &= same(s1.value(i, j), m);
        if (has_state2()) ok &= same(s2.value(i, j), v);
        if (has_state3()) ok &= same(s3.value(i, j), max_v);
        if (kind == ParamKind::kMaster) {  // the copy is the master as written, rounded
          const uint16_t bits = lp.half[i][j + lp.shift[i]];
          const float written = master.value(i, j);
          // (a NaN as any NaN: CUDA's conversions write the NaN 0x7FFF, torch's and the CPU's 0x7FC0)
          const bool nan = written != written;
          ok &= kept ? bits == before.lp.half[i][j + lp.shift[i]]
                      : nan ? lp.value(i, j) != lp.value(i, j)
                            : bits == (lp.dtype(i) == DType::kBF16 ? cpu::float_to_bf16(written) : cpu::float_to_f16(written));
        }
        ok &= acc.value(i, j) == before.acc.value(i, j);  // acc is read, never written
        if (!ok) ++bad;
        CHECK(ok, "%s %s states %d%d%d kind=%d fused=%d found=%d: tensor %zu [%lld]", what, algo.c_str(),
              int(uses[0]), int(uses[1]), int(uses[2]),
              int(kind), int(fused), int(found), i, (long long)j);
      }
    }
    CHECK(acc.padding_intact() && master.padding_intact() && s1.padding_intact() &&
              s2.padding_intact() && s3.padding_intact(), "%s: padding written", what);
  }
};

// f(Algo{}) for every algorithm of FUSED_ACCUM_ALGORITHMS.
template <class F>
void for_each_algorithm(F&& f) {
#define FA_FOR_ALGORITHM(A) f(math::A{});
  FUSED_ACCUM_ALGORITHMS(FA_FOR_ALGORITHM)
#undef FA_FOR_ALGORITHM
}

// The state lists a call of Algo uses (uses[k]: state k + 1) when every list it takes is given
// (given), or every one is empty (!given: those it may leave out are left out).
template <class Algo>
void state_uses(const typename Algo::Hyper& h, bool given, bool (&uses)[3]) {
  for (int k = 0; k < 3; ++k) uses[k] = k < math::kStateCount<Algo> && Algo::uses_state(k, h, given);
}

// The per-element rule of case c: Algo's update, its mode picked as the kernels pick it.
template <class Algo>
StepRule rule_of(const StepCase& c, const typename Algo::Hyper& h) {
  return [&c, h](float g, float& p, float& s1, float& s2, float& s3, size_t i) {
    const int64_t rows = Algo::kShaped ? c.rows[i] : 1;
    math::update<Algo>(g, p, s1, s2, s3, c.uses[2], h, math::tensor_scalars<Algo>(c.lr, c.steps[i], h, rows, c.sizes[i]));
  };
}

// Every algorithm of FUSED_ACCUM_ALGORITHMS, in both hyper_cases, with every state list given and
// with those it may leave out left out (Adam's amsgrad), x param kind x fused mode x found_inf,
// on `sizes`. run.template operator()<Algo>(lists, args, hyper) calls the kernel under test.
template <class Run>
void check_all_steps(const std::vector<int64_t>& sizes, const Run& run, const char* what) {
  unsigned seed = 0;
  for_each_algorithm([&](auto algo) {
    using Algo = decltype(algo);
    for (const bool zeros : {false, true}) {
      const typename Algo::Hyper h = hyper_case<Algo>(&Algo::hyper, zeros);
      bool all[3], fewest[3];
      state_uses<Algo>(h, true, all);
      state_uses<Algo>(h, false, fewest);
      const std::string name = std::string(Algo::kOp) + (zeros ? "(zeros)" : "(values)");
      const StepRunner runner = [&](const TensorLists& t, const StepArgs& a) { run.template operator()<Algo>(t, a, h); };
      for (const bool* uses : {all, fewest}) {
        if (uses == fewest && std::equal(all, all + 3, fewest)) continue;  // (the same case again)
        for (ParamKind kind : {ParamKind::kMaster, ParamKind::kF32, ParamKind::kBF16, ParamKind::kRemainder})
          for (Fused fused : {Fused::kNone, Fused::kAdd, Fused::kOverwrite})
            for (bool found : {false, true}) {
              StepCase c(sizes, name, uses, kind, fused, found, ++seed);
              c.as_of<Algo>().run_and_check(runner, rule_of<Algo>(c, h), what);
            }
      }
    }
  });
}

}  // namespace fa_test
