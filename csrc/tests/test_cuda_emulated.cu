// The CUDA kernels' per-thread code run on the CPU: every block and thread of every launch is
// emulated in turn, through the same multi-tensor tables (for_each_table), chunk lookup, 16-byte
// pack loads with scalar tails, and bf16/fp16 conversions as on the GPU. Only the launch itself,
// the block reduction of accumulate's statistics and the hardware are not covered: those are
// checked by tests/test_ext.py and tests/test_kernels.py on a GPU (pytest -m gpu).
//
// Sizes span several 8K-element chunks, and the lists are longer than one table holds, so the
// relaunch path runs. Every fourth gradient is not 16-byte aligned (the scalar path). The exact
// 2-byte masters (step_case.h's kRemainder) run the kernel's remainder instantiation: 16-byte
// packs of 8 bf16 params and 8 int16 remainders where both are aligned, element by element
// where either is not (every fourth param, a different every fourth remainder).
#include "../cuda/accumulate.cu"
#include "../cuda/fold.cu"
#include "../cuda/step.cu"
#include "check.h"
#include "data.h"
#include "step_case.h"

using namespace fused_accum;
using namespace fa_test;

namespace {

int launches = 0;

constexpr int64_t kChunk = cuda::kChunk;

// Sizes around the chunk and pack (8) boundaries, then random ones up to 3 chunks.
std::vector<int64_t> sizes_for(int count, unsigned seed) {
  std::vector<int64_t> sizes = {1, 7, 8, 9, kChunk - 1, kChunk, kChunk + 1, 5 * kChunk / 2 + 3};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> any(1, 3 * cuda::kChunk);
  while (static_cast<int>(sizes.size()) < count) sizes.push_back(any(rng) % 3 ? any(rng) % 3000 + 1 : any(rng));
  return sizes;
}

void test_accumulate(bool overwrite) {
  const int count = cuda::AccTable::kCapacity + 17;  // two launches
  const std::vector<int64_t> sizes = sizes_for(count, 11);
  std::mt19937 rng(overwrite);
  Flat acc(sizes, rng);
  Mixed grad(sizes, rng);
  const Flat before = acc;
  TensorLists t;
  for (size_t i = 0; i < sizes.size(); ++i) {
    t.numel.push_back(sizes[i]);
    t.index.push_back(static_cast<int64_t>(i));
    t.acc.add(acc.at(i), DType::kF32);
    t.grad.add(grad.ptr(i), grad.dtype(i));
  }
  double sumsq = 0.0;
  bool nonfinite = false;
  launches = 0;
  const Operand* const ops[2] = {&t.acc, &t.grad};
  const char* err = cuda::for_each_table(t, ops, [&](const cuda::AccTable& table, int chunks) {
    ++launches;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      for (int thread = 0; thread < cuda::kThreads; ++thread) {
        const cuda::ThreadStats s = cuda::accumulate_thread(table, 0.37f, overwrite, chunk, thread);
        sumsq += s.sumsq;
        nonfinite |= s.nonfinite;
      }
    }
    return static_cast<const char*>(nullptr);
  });
  CHECK(err == nullptr && launches == 2, "launches %d", launches);
  double want_sumsq = 0.0;
  int bad = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int64_t j = 0; j < sizes[i] && bad < 5; ++j) {
      const float want = math::accumulate(before.value(i, j), grad.value(i, j), 0.37f, overwrite);
      want_sumsq += double(want) * want;
      const bool ok = close(acc.value(i, j), want);
      bad += !ok;
      CHECK(ok, "overwrite=%d tensor %zu (dtype %d) [%lld]: %g want %g", overwrite, i,
            int(grad.dtype(i)), (long long)j, acc.value(i, j), want);
    }
  }
  CHECK(acc.padding_intact(), "padding written");
  CHECK(std::fabs(sumsq - want_sumsq) <= 1e-5 * want_sumsq, "sumsq %g want %g", sumsq, want_sumsq);
  CHECK(!nonfinite, "non-finite flagged on finite values");
}

template <class Algo, bool kState3>
void emulate_step(const TensorLists& t, const StepArgs& a, const typename Algo::Hyper& h) {
  // As launch_step in step.cu builds them.
  const cuda::DeviceStepArgs args{a.lr, a.coef, a.steps, a.found_inf, a.grad_alpha,
                                  t.grad.present(), a.grads_overwrite, a.maximize};
  const auto run = [&](const auto& table, int chunks) {
    ++launches;
    for (int chunk = 0; chunk < chunks; ++chunk)
      for (int thread = 0; thread < cuda::kThreads; ++thread)
        cuda::step_thread<Algo>(table, args, h, chunk, thread);
    return static_cast<const char*>(nullptr);
  };
  if constexpr (kState3) {  // a third state list (amsgrad's max_exp_avg_sq) is a 7th operand, last
    const Operand* const ops[7] = {&t.acc,    &t.grad,             &t.param, &t.state1,
                                   &t.state2, cuda::lp_column(t), &t.state3};
    cuda::for_each_table<7, Algo::kShaped>(t, ops, run);
  } else {
    const Operand* const ops[6] = {&t.acc, &t.grad, &t.param, &t.state1, &t.state2, cuda::lp_column(t)};
    cuda::for_each_table<6, Algo::kShaped>(t, ops, run);
  }
}

// Each algorithm's kernel, emulated, as step_cuda picks it (step_case.h's check_all_steps calls it).
struct EmulatedStep {
  template <class Algo>
  void operator()(const TensorLists& t, const StepArgs& a, const typename Algo::Hyper& h) const {
    if constexpr (math::kState3Required<Algo>) {
      emulate_step<Algo, true>(t, a, h);
    } else {
      if (t.state3.present()) emulate_step<Algo, true>(t, a, h);
      else emulate_step<Algo, false>(t, a, h);
    }
  }
};

void test_steps() {
  check_all_steps({1, 7, 1023, kChunk + 1, 3, 5 * kChunk / 2 + 3, 8, 9, 17}, EmulatedStep{}, "cuda-emulated");
  // More tensors than one table holds (the relaunch path), for each algorithm, without and
  // (where it takes one) with a third state list, whose 7-operand table holds fewer tensors.
  for_each_algorithm([&](auto algo) {
    using Algo = decltype(algo);
    const typename Algo::Hyper h = hyper_case<Algo>(&Algo::hyper, false);
    bool all[3], fewest[3];
    state_uses<Algo>(h, true, all);
    state_uses<Algo>(h, false, fewest);
    for (const bool* uses : {fewest, all}) {
      if (uses == all && (!all[2] || fewest[2])) continue;  // (none, or the case already run)
      const int count = (uses[2] ? cuda::TableOf<Algo, true>::kCapacity : cuda::TableOf<Algo, false>::kCapacity) + 5;
      StepCase c(sizes_for(count, 5 + uses[2]), Algo::kOp, uses, ParamKind::kMaster, Fused::kAdd, false, 99);
      c.as_of<Algo>();
      launches = 0;
      const StepRunner runner = [&](const TensorLists& t, const StepArgs& a) { EmulatedStep{}.operator()<Algo>(t, a, h); };
      c.run_and_check(runner, rule_of<Algo>(c, h), "cuda-emulated, two tables");
      CHECK(launches == 2, "%s state3=%d: launches %d", Algo::kOp, int(uses[2]), launches);
    }
  });
}

// fold_pieces: every block and thread of each launch emulated, against the adds done here in
// list order, bit for bit (finite data, -0.0 planted). 300 pieces take two launches; an offset
// of one element makes the pieces unaligned (the element-by-element path).
void test_fold_pieces() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{9}, kChunk + 1, 3 * kChunk + 5}) {
    for (const DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const int count : {1, 2, 5, 300}) {
        for (const int skew : {0, 1}) {
          for (const bool overwrite : {false, true}) {
            const int64_t es = dt == DType::kF32 ? 4 : 2;
            std::vector<std::vector<uint8_t>> pieces(count, std::vector<uint8_t>((n + skew) * es));
            std::vector<float> acc(n), want(n);
            for (auto& a : acc) a = normal(rng) * 100.0f;
            acc[0] = -0.0f;
            FoldArgs f;
            f.acc = acc.data();
            f.numel = n;
            f.dtype = dt;
            f.overwrite = overwrite;
            for (int k = 0; k < count; ++k) {
              uint8_t* p = pieces[k].data() + skew * es;
              for (int64_t j = 0; j < n; ++j) {
                const float v = j == 0 && k < 2 ? -0.0f : normal(rng) * float(1 << (k % 8));
                if (dt == DType::kF32) memcpy(p + j * 4, &v, 4);
                else {
                  const uint16_t h = dt == DType::kBF16 ? cuda::float_to_bf16_bits(v) : cuda::float_to_f16_bits(v);
                  memcpy(p + j * 2, &h, 2);
                }
              }
              f.pieces.push_back(p);
            }
            for (int64_t j = 0; j < n; ++j) {
              float a = overwrite ? cuda::load_one(f.pieces[0], uint8_t(dt), j) : acc[j];
              for (int k = overwrite ? 1 : 0; k < count; ++k) a = a + cuda::load_one(f.pieces[k], uint8_t(dt), j);
              want[j] = a;
            }
            launches = 0;
            const int chunks = static_cast<int>(cuda::fold_chunks(f));
            const char* err = cuda::for_each_fold_table(f, [&](const cuda::FoldTable& table) {
              ++launches;
              for (int chunk = 0; chunk < chunks; ++chunk)
                for (int thread = 0; thread < cuda::kThreads; ++thread) cuda::fold_thread(f.acc, n, table, chunk, thread);
              return static_cast<const char*>(nullptr);
            });
            CHECK(err == nullptr && launches == (count + cuda::kMaxFoldPieces - 1) / cuda::kMaxFoldPieces,
                  "launches %d for %d pieces", launches, count);
            int bad = 0;
            for (int64_t j = 0; j < n && bad < 5; ++j) {
              const bool ok = memcmp(&acc[j], &want[j], 4) == 0;
              bad += !ok;
              CHECK(ok, "fold_pieces n=%lld dtype %d pieces %d skew %d overwrite %d [%lld]: %g want %g",
                    (long long)n, int(dt), count, skew, int(overwrite), (long long)j, acc[j], want[j]);
            }
          }
        }
      }
    }
  }
}

}  // namespace

TEST_MAIN(test_accumulate(false); test_accumulate(true); test_steps(); test_fold_pieces())
