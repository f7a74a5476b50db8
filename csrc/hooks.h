// fused_accum._C.Arrivals: the table of a gradient window's per-parameter autograd hooks, declared
// here and defined and bound (bind_arrivals, called by csrc/module.cpp) in csrc/hooks.cpp. Its
// members are the contract's, written once in fused_accum/arrivals.py: HookTable, and the values
// the window and the table exchange one call each way at each end of a backward: a Look taken
// (look) and a Plan handed in (hand) at its start, the Report taken back (report) and the next
// Plan handed, with .grad's views (hand's show), at its end. This table acts on the whole plan, its fast path included
// (the fast folds and quiet backwards): the plan's fields are members here, below.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>  // (pybind11, its STL casters and torch's Tensor caster)

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fused_accum {

namespace py = pybind11;

// One bucket's arrivals in the backward now running, by position in the bucket.
struct BucketArrivals {
  std::vector<at::Tensor> grads;  // undefined: nothing arrived as a tensor
  std::vector<char> arrived;      // as a tensor or written in place
  int64_t count = 0;              // how many positions have arrived
  // Set by the plan's grants (Grant): when complete (every gradient a tensor, on acc's
  // device), fold here with accumulate_(acc, offsets, grads, 1, overwrite) and do not call Python.
  bool fast = false;
  bool overwrite = false;  // (the window's first gradients: copied, and reported as overwritten)
  at::Tensor acc, offsets;
  int folded_task = -1;  // the backward (graph task) whose gradients the grant last folded
  // Its gradients are handed to the window (bucket_complete runs): no plan grants it until the
  // window has folded them (another thread's backward may hand a plan meanwhile).
  bool with_window = false;
};

// Hidden, as pybind11 makes its own types: a class that holds py::objects may not be more visible
// than they are (GCC warns), and nothing outside fused_accum._C links against it.
class __attribute__((visibility("hidden"))) Arrivals : public std::enable_shared_from_this<Arrivals> {
 public:
  // The window's callbacks (fused_accum/arrivals.py says when each is called).
  Arrivals(py::object before_backward, py::object queue_end, py::object bucket_complete, py::object fold_hooked,
           py::object backward_raised);
  ~Arrivals();

  // --- HookTable: the plan and the report (fused_accum/arrivals.py Plan and Report) ---
  void hand(const py::object& plan, const py::object& show);
  py::object plan();
  py::object report(bool end);

  // --- HookTable: the slots and their .grad ---
  void extend(const std::vector<int64_t>& bucket_sizes, const std::vector<int64_t>& slot_bucket,
              const std::vector<int64_t>& slot_position, const std::vector<std::string>& names);
  void attach(int64_t key, const at::Tensor& param);
  py::object look(const std::vector<at::Tensor>& params);
  void detach_all();
  void arrive_in_place(int64_t key);
  void clear();
  bool clear_grads();
  bool has_arrivals();

  // --- the hooks on each AccumulateGrad node (hooks.cpp's TakeGradBefore and TakeGradAfter) ---
  torch::autograd::variable_list before_accumulate(int64_t key, torch::autograd::AccumulateGrad& node,
                                                   const torch::autograd::variable_list& grads);
  void after_accumulate(int64_t key, torch::autograd::AccumulateGrad& node);

  // --- compiled autograd: what the pre-hook puts in the captured graph (hooks.cpp's
  // TakeGradBefore::compiled_args; the protocol's compile_with says what each callback does) ---
  void compile_with(py::object compiled_backward, py::object compiled_first);
  void compiled_pre_hook(int64_t key, torch::autograd::AccumulateGrad& node,
                         torch::dynamo::autograd::CompiledNodeArgs& args);
  void compiled_post_hook(int64_t key, torch::dynamo::autograd::CompiledNodeArgs& args);

 private:
  // The AccumulateGrad nodes we hook. The pointer type is whatever grad_accumulator() returns:
  // std::shared_ptr<Node> up to torch 2.12, c10::intrusive_ptr<Node> from 2.13 on.
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  struct QuietEnd;

  bool standing_aside() const { return detached_ || stands_aside_; }
  const at::Tensor& param_of(size_t key) const;
  std::vector<int64_t> changed_locked(bool any);
  void expose_locked(const std::vector<std::optional<at::Tensor>>& views, const std::vector<bool>& held);
  void hook_locked(int64_t key, NodePtr node);  // (with mutex_ held)
  bool start_quietly();
  void raised_quietly(int task);
  void end_quietly(int task);
  void arrive(int64_t key, at::Tensor grad);

  // The plan's flags: the hooks stand aside (DDP or FSDP2 owns .grad); the pre-hook asks Python
  // first (slow_: the plan's, or false while a backward runs quietly; slow_planned_: the plan's);
  // the pre-hook hides a defined .grad.
  std::atomic<bool> stands_aside_{false}, slow_{true}, hide_{false};
  bool slow_planned_ = true;
  std::atomic<bool> detached_{false};
  std::vector<int64_t> slot_bucket_, slot_position_;
  std::vector<std::string> names_;
  py::object before_backward_, queue_end_, bucket_complete_, fold_hooked_, backward_raised_;
  std::vector<BucketArrivals> buckets_;
  std::vector<NodePtr> nodes_;      // by slot: the AccumulateGrad nodes we hook (kept alive)
  std::vector<at::Tensor> hidden_;  // by slot: the .grad the pre-hook hid, until the post-hook
  std::vector<at::Tensor> shown_;   // by slot: what hand's show set .grad to (undefined: nothing)
  std::vector<const void*> shown_data_;  // by slot: where that view's memory was when shown
  // Autograd runs one thread per device, and two threads may each run a backward of one model:
  // buckets are filled from several. The fast folds run under it too (see arrive()).
  std::mutex mutex_;
  int last_task_ = -1;  // the graph task whose end Python was last asked to see
  std::vector<int64_t> overwritten_;  // the buckets an overwrite grant filled (the next report's)
  // Quiet backwards: whether one may start (the plan's quiet_until above counters_[1], and no
  // check failed since); the backward running quietly (-1: none) and whether it still needs
  // nothing of Python; the plan's seen, quiet_until, counters (the window's change counter and
  // the count of quiet backwards, read and written in place) and at.
  std::atomic<bool> armed_{false};
  int quiet_task_ = -1;
  bool quiet_clean_ = false;
  int python_task_ = -1;
  int64_t quiet_until_ = 0;
  py::object counters_object_;
  int64_t* counters_ = nullptr;
  int64_t at_ = 0;
  py::object types_;  // fused_accum.arrivals, for its Plan, Grant and Report
  // Compiled autograd: the window's two callbacks (compile_with), the backward (graph task)
  // being captured, and by slot what its graph holds: (fold, show, view) (None: not asked yet).
  py::object compiled_backward_, compiled_first_;
  int compiled_task_ = -1;
  std::vector<py::object> compiled_folds_;
};

// Binds Arrivals as fused_accum._C.Arrivals (module.cpp calls it).
void bind_arrivals(py::module_& m);

}  // namespace fused_accum
