// fused_accum._C's Python module, and the per-parameter autograd hooks of a gradient window in C++
// (fused_accum/arrivals.py has their Python twin and describes what both do).
//
// Why C++: the hooks run once per parameter per backward. As Python callables each costs the
// autograd engine a GIL acquisition and two tensor wraps, several microseconds per parameter, more
// than torch's own `.grad += g`. Here each is a few pointer operations; Python is called once per
// complete bucket and once per backward, and not at all in the middle backwards of a window
// (quiet backwards: arm_quiet).
//
// The hooks are node hooks on each parameter's AccumulateGrad node (which the table keeps alive):
// unlike tensor hooks they live beside, not instead of, the hooks users register from Python
// (assigning a tensor's Python hook dict clears its C++ tensor hooks), and, unlike tensor
// pre-hooks, they run only when AccumulateGrad runs (not for torch.autograd.grad's captures).
#include <torch/extension.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#ifndef FA_WITH_CUDA
#define FA_WITH_CUDA 0
#endif

namespace fused_accum {
namespace {

namespace py = pybind11;
using torch::autograd::AccumulateGrad;
using torch::autograd::FunctionPostHook;
using torch::autograd::FunctionPreHook;
using torch::autograd::Node;
using torch::autograd::variable_list;

// One bucket's arrivals in the backward now running, by position in the bucket.
struct BucketArrivals {
  std::vector<at::Tensor> grads;  // undefined: nothing arrived as a tensor
  std::vector<char> arrived;      // as a tensor or written in place
  int64_t count = 0;              // how many positions have arrived
  // Set by grant_fast for this backward: when complete (every gradient a tensor, on acc's
  // device), fold here with accumulate_(acc, offsets, grads, 1, overwrite) and do not call Python.
  bool fast = false;
  bool overwrite = false;  // (the window's first gradients: copied, and listed for take_overwritten)
  at::Tensor acc, offsets;
  int folded_task = -1;  // the backward (graph task) whose gradients the grant last folded
};

// fused_accum_ext::accumulate_ (bindings.cpp), through the dispatcher: CPU or CUDA by device.
void fold_into(const at::Tensor& acc, const at::Tensor& offsets, at::TensorList grads, bool overwrite) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_accum_ext::accumulate_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, at::TensorList, double, bool,
                                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  at::NoGradGuard no_grad;  // (a double backward runs the hooks in grad mode: the sums keep no graph)
  op.call(acc, offsets, grads, 1.0, overwrite, std::nullopt, std::nullopt);
}

class Arrivals : public std::enable_shared_from_this<Arrivals> {
 public:
  Arrivals(py::object before_backward, py::object queue_end, py::object bucket_complete, py::object fold_hooked,
           py::object backward_raised)
      : before_backward_(std::move(before_backward)),
        queue_end_(std::move(queue_end)),
        bucket_complete_(std::move(bucket_complete)),
        fold_hooked_(std::move(fold_hooked)),
        backward_raised_(std::move(backward_raised)) {}

  // New buckets (numbered on from the last) and new slots (keys numbered on from the last), each
  // slot at a position of a bucket, with the parameter's name for errors.
  void extend(const std::vector<int64_t>& bucket_sizes, const std::vector<int64_t>& slot_bucket,
              const std::vector<int64_t>& slot_position, const std::vector<std::string>& names) {
    TORCH_CHECK(slot_bucket.size() == slot_position.size() && names.size() == slot_bucket.size(),
                "Arrivals.extend: slot tables differ in length");
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t size : bucket_sizes) {
      TORCH_CHECK(size > 0, "Arrivals.extend: an empty bucket");
      buckets_.emplace_back();
      buckets_.back().grads.resize(size);
      buckets_.back().arrived.assign(size, 0);
    }
    for (size_t i = 0; i < slot_bucket.size(); ++i) {
      const int64_t b = slot_bucket[i], pos = slot_position[i];
      TORCH_CHECK(b >= 0 && b < (int64_t)buckets_.size() && pos >= 0 &&
                      pos < (int64_t)buckets_[b].grads.size(),
                  "Arrivals.extend: slot ", slot_bucket_.size(), " names no bucket position");
      slot_bucket_.push_back(b);
      slot_position_.push_back(pos);
      names_.push_back(names[i]);
    }
    nodes_.resize(slot_bucket_.size());
    hidden_.resize(slot_bucket_.size());
    shown_.resize(slot_bucket_.size());
    shown_data_.resize(slot_bucket_.size());
  }

  // Usually run by Python, with the GIL. A hook that outlived the window's last Python
  // reference may run it on an autograd thread, without the GIL that releasing Python objects
  // needs. The hooks are not removed here (this may be inside one of them): they go inert.
  ~Arrivals() {
    py::gil_scoped_acquire gil;
    changes_object_ = py::object();
    before_backward_ = py::object();
    queue_end_ = py::object();
    bucket_complete_ = py::object();
    fold_hooked_ = py::object();
    backward_raised_ = py::object();
  }

  void attach(int64_t key, const at::Tensor& param);

  // The keys whose parameter (`params`, by key: the Python objects the optimizer holds) has
  // another AccumulateGrad node than the one hooked, hooked again on the new node. A `.data`
  // that changed device or dtype (model.to(...)) makes autograd build a new node, without our
  // hooks, at the next forward (asking for it here builds it now, and the forward then uses
  // that one); torch.utils.swap_tensors gives the object another tensor, with its own node.
  std::vector<int64_t> rehook(const std::vector<at::Tensor>& params);

  // The pre-hook. Usually it takes the gradient into its bucket itself and hands AccumulateGrad
  // an undefined one, which the node skips: `.grad` is not touched (it keeps showing the running
  // sum), and autograd neither detaches nor stores anything. A parameter with a user's
  // post-accumulate-grad hook is folded at once by the window (fold_hooked) into the running
  // sum `.grad` shows; AccumulateGrad, handed an undefined gradient, still runs that hook, which
  // so sees the sum, as natively. AccumulateGrad
  // must run where it does more than store the gradient: a double backward keeps the gradient's
  // graph, a non-strided or zero tensor needs its handling, a parameter that no longer requires
  // grad drops it (and the window may decline a hooked one). There the pre-hook hides a `.grad`
  // that shows the running sum (else autograd would add into it), and the post-hook takes what
  // AccumulateGrad stored.
  variable_list before_accumulate(int64_t key, AccumulateGrad& node, const variable_list& grads) {
    if (standing_aside()) return grads;
    if (slow_) {
      if (!start_quietly()) call(before_backward_);
      if (standing_aside()) return grads;
    }
    if (grads.size() != 1 || !grads[0].defined()) return grads;
    const at::Tensor& param = node.variable;
    const at::Tensor& grad = grads[0];
    const bool plain = grad.layout() == at::kStrided && !grad._is_zerotensor() && param.requires_grad() &&
                       !at::GradMode::is_enabled();
    if (plain && !node.tensor_post_acc_grad_hooks()) {
      arrive(key, grad);
      return variable_list(1);
    }
    if (plain && call_bool(fold_hooked_, key, grad)) return variable_list(1);
    if (hide_) {
      at::Tensor& shown = param.mutable_grad();
      if (shown.defined()) {
        std::lock_guard<std::mutex> lock(mutex_);
        hidden_[key] = std::move(shown);
        shown.reset();
      }
    }
    return grads;
  }

  // The post-hook, after AccumulateGrad ran on a gradient the pre-hook left to it: take what it
  // stored in `.grad` into the bucket, and show again what the pre-hook hid (the running sum,
  // which the bucket's fold brings up to date).
  void after_accumulate(int64_t key, const at::Tensor& param) {
    if (standing_aside()) return;
    at::Tensor grad;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      grad = std::move(param.mutable_grad());
      param.mutable_grad() = std::move(hidden_[key]);
      hidden_[key].reset();
    }
    if (!grad.defined()) return;  // (dropped: the parameter no longer requires grad)
    TORCH_CHECK(grad.layout() == at::kStrided, "parameter ", names_.at(key),
                " received a sparse gradient; sparse gradients are not supported");
    arrive(key, std::move(grad));
  }

  // A slot whose gradient was written straight into the accumulator (fused weight gradient).
  void arrive_in_place(int64_t key) { arrive(key, at::Tensor()); }

  // Partly arrived buckets, emptied: [(bucket, grads)] (the end of a backward).
  std::vector<std::pair<int64_t, std::vector<at::Tensor>>> take_partial() {
    std::vector<std::pair<int64_t, std::vector<at::Tensor>>> out;
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (buckets_[b].count) out.emplace_back(b, take(buckets_[b]));
    }
    return out;
  }

  // A fold that needs nothing of Python (no norm, no reduction, no fused step, the extension's
  // backend; an add where every slot of the bucket holds this window's gradient, an overwrite
  // where none does) is granted per bucket by the window for the backward about to run.
  void grant_fast(const std::vector<int64_t>& buckets, const std::vector<at::Tensor>& accs,
                  const std::vector<at::Tensor>& offsets, const std::vector<bool>& overwrite) {
    TORCH_CHECK(buckets.size() == accs.size() && accs.size() == offsets.size() && offsets.size() == overwrite.size(),
                "Arrivals.grant_fast: lists differ in length");
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < buckets.size(); ++i) {
      TORCH_CHECK(buckets[i] >= 0 && buckets[i] < (int64_t)buckets_.size(), "Arrivals.grant_fast: no bucket ",
                  buckets[i]);
      BucketArrivals& bucket = buckets_[buckets[i]];
      bucket.fast = true;
      bucket.overwrite = overwrite[i];
      bucket.acc = accs[i];
      bucket.offsets = offsets[i];
    }
  }

  void revoke_fast() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& bucket : buckets_) revoke(bucket);
  }

  // The buckets overwritten by a granted fold since the last call: their slots now hold the
  // window's first gradient, which the window records (it cannot be told from inside a hook).
  std::vector<int64_t> take_overwritten() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t> out;
    out.swap(overwritten_);
    return out;
  }

  // Forgets every arrival, and which backward was seen (a backward that raised never ends).
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& bucket : buckets_) {
      take(bucket);
      revoke(bucket);
    }
    for (auto& grad : hidden_) grad.reset();
    overwritten_.clear();
    last_task_ = -1;
    quiet_left_ = 0;
    quiet_clean_ = false;  // (a quiet backward still running hands its end to Python)
  }

  // The window's `.grad` exposure (fused_accum.window.expose), here because it touches every
  // parameter once per backward: `.grad` = views[key] where show[key]; else None where it was that
  // view. What is shown is remembered for changed().
  void expose(const std::vector<std::optional<at::Tensor>>& views, const std::vector<bool>& show) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (detached_) return;  // (the nodes are let go)
    TORCH_CHECK(views.size() == nodes_.size() && show.size() == nodes_.size(),
                "Arrivals.expose: expected one view and one flag per slot");
    for (size_t key = 0; key < nodes_.size(); ++key) {
      if (!nodes_[key]) continue;
      at::Tensor& grad = param_of(key).mutable_grad();
      const at::Tensor view = views[key].value_or(at::Tensor());
      if (show[key] && view.defined()) {
        if (!grad.is_same(view)) grad = view;
        shown_[key] = view;
        shown_data_[key] = view.const_data_ptr();
      } else {
        if (view.defined() && grad.is_same(view)) grad.reset();
        shown_[key].reset();
      }
    }
  }

  // Every hooked parameter's `.grad` becomes None (zero_grad()). False when detached (the nodes
  // are let go): the caller clears them itself.
  bool clear_grads() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (detached_) return false;
    for (size_t key = 0; key < nodes_.size(); ++key) {
      if (nodes_[key]) param_of(key).mutable_grad().reset();
      shown_[key].reset();
    }
    return true;
  }

  // The keys whose `.grad` is no longer what expose() showed (the user cleared or replaced it).
  std::vector<int64_t> changed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return changed_locked(false);
  }

  bool has_arrivals() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& bucket : buckets_) {
      if (bucket.count) return true;
    }
    return false;
  }

  // --- quiet backwards (see arrivals.py) ---

  // The next `budget` backwards may run without Python while `*changes` (the window's counter of
  // what its decisions depend on, an int64 buffer) keeps its present value.
  void arm_quiet(int64_t budget, const py::buffer& changes) {
    const py::buffer_info info = changes.request();
    TORCH_CHECK(info.itemsize == sizeof(int64_t) && info.size == 1 && info.format == py::format_descriptor<int64_t>::format(),
                "Arrivals.arm_quiet: changes must be one int64");
    std::lock_guard<std::mutex> lock(mutex_);
    changes_object_ = changes;  // (keeps the buffer alive)
    changes_ = static_cast<const int64_t*>(info.ptr);
    armed_at_ = *changes_;
    quiet_left_ = budget;
  }

  // Backwards that ended quietly since the last call (the window adds them to its counts).
  int64_t take_quiet_backwards() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(quiet_done_, 0);
  }

  // The window queued its own end callback for the backward now running (it is not quiet).
  void python_seen() {
    std::lock_guard<std::mutex> lock(mutex_);
    quiet_clean_ = false;
    python_task_ = torch::autograd::get_current_graph_task_id();
  }

  // Hooks stand aside for good (the window was detached); the nodes are let go. The hooks are not
  // removed from them: this may run inside one of them.
  void detach_all() {
    detached_ = true;
    std::lock_guard<std::mutex> lock(mutex_);
    nodes_.clear();
  }

  bool standing_aside() const { return detached_ || native_; }

  // Set from Python (see arrivals.py): the hooks stand aside (DDP owns .grad); the pre-hook asks
  // Python first; the pre-hook hides a defined .grad.
  std::atomic<bool> native_{false}, slow_{true}, hide_{false};
  std::atomic<bool> detached_{false};

 private:
  // The parameter of a hooked slot (its AccumulateGrad node holds it).
  const at::Tensor& param_of(size_t key) const {
    return static_cast<const AccumulateGrad*>(nodes_[key].get())->variable;
  }

  // The keys whose `.grad` is not what expose() showed; with `any`, stops at the first.
  std::vector<int64_t> changed_locked(bool any) {
    std::vector<int64_t> out;
    for (size_t key = 0; key < nodes_.size(); ++key) {
      if (!nodes_[key]) continue;
      // (the same tensor re-pointed by `p.grad.data = t` is a change too: its memory is not ours)
      const at::Tensor& grad = param_of(key).grad();
      if (!grad.is_same(shown_[key]) || (grad.defined() && grad.const_data_ptr() != shown_data_[key])) {
        out.push_back(key);
        if (any) break;
      }
    }
    return out;
  }

  // At the first gradient of a backward (while `slow_`): true if it runs quietly, having checked
  // here what the window's before_backward would (nothing it decided from changed, no `.grad`
  // the user changed, nothing left over from a backward that raised, not a double backward); it
  // then sees its own end (end_quietly). False: the window's before_backward is to run.
  bool start_quietly() {
    if (quiet_left_ <= 0 || at::GradMode::is_enabled()) return false;
    const int task = torch::autograd::get_current_graph_task_id();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!slow_) return true;  // (another device's thread started this backward quietly)
      const bool ready = quiet_left_ > 0 && *changes_ == armed_at_ && task != python_task_ &&
                         overwritten_.empty() &&
                         std::none_of(buckets_.begin(), buckets_.end(), [](const BucketArrivals& b) { return b.count; }) &&
                         changed_locked(true).empty();
      if (!ready) {
        quiet_left_ = 0;  // (the window arms again at the end of the backward it runs)
        return false;
      }
      quiet_task_ = task;
      quiet_clean_ = true;
      last_task_ = task;  // (arrive() does not ask Python to see this backward's end)
      slow_ = false;
    }
    // The engine drops its final callbacks unrun when the backward raises: the guard then
    // tells the window (raised_quietly), which shows in `.grad` what arrived before the error.
    auto end = std::make_shared<QuietEnd>(weak_from_this(), task);
    torch::autograd::Engine::get_default_engine().queue_callback([end] {
      end->ran = true;
      if (auto table = end->table.lock()) table->end_quietly(end->task);
    });
    return true;
  }

  struct QuietEnd {
    QuietEnd(std::weak_ptr<Arrivals> table, int task) : table(std::move(table)), task(task) {}
    ~QuietEnd() {
      if (ran) return;
      if (auto arrivals = table.lock()) arrivals->raised_quietly(task);
    }
    std::weak_ptr<Arrivals> table;
    int task;
    bool ran = false;
  };

  // A backward started quietly raised before its end. Unless the window saw it (then its own
  // end callback, dropped too, tells it), hand the window what arrived: backward_raised().
  void raised_quietly(int task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (task != quiet_task_) return;
      quiet_task_ = -1;
      quiet_left_ = 0;
      slow_ = true;
      if (task == python_task_) return;
    }
    py::gil_scoped_acquire gil;
    try {
      backward_raised_();
    } catch (py::error_already_set& err) {
      err.discard_as_unraisable("fused_accum: after a backward that raised");  // (a destructor: cannot throw)
    }
  }

  // The end of a backward started quietly. If it stayed so (every bucket complete and folded
  // here, no other backward inside it, Python not called) it is only counted, and the next
  // backward is checked again (`slow_`); else its end is handed to the window (queue_end), as
  // though its first gradient had asked. The grants stay for the next quiet backward.
  void end_quietly(int task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (standing_aside() || task != quiet_task_) return;
      quiet_task_ = -1;
      if (task == python_task_) return;  // the window's own end callback ends it
      const bool quiet = quiet_clean_ && !torch::autograd::get_current_node() &&
                         std::none_of(buckets_.begin(), buckets_.end(), [](const BucketArrivals& b) { return b.count; });
      if (quiet) {
        ++quiet_done_;
        --quiet_left_;
        slow_ = true;
        return;
      }
      quiet_left_ = 0;
    }
    call(queue_end_);
  }

  // One lock per arrival (the hot path). An undefined `grad`: the slot was written in place.
  void arrive(int64_t key, at::Tensor grad) {
    const bool in_place = !grad.defined();
    const int task = in_place ? -1 : torch::autograd::get_current_graph_task_id();
    bool new_task = false;
    int64_t complete = -1;
    std::vector<at::Tensor> grads;
    at::Tensor fast_acc, fast_offsets;
    bool fast_overwrite = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(key >= 0 && key < (int64_t)slot_bucket_.size(), "Arrivals: no slot ", key);
      if (!in_place) {
        new_task = task != last_task_;  // (in place: the caller told Python itself)
        last_task_ = task;
        if (new_task && quiet_task_ >= 0) quiet_clean_ = false;  // a backward inside a quiet one
      }
      BucketArrivals& bucket = buckets_[slot_bucket_[key]];
      const int64_t pos = slot_position_[key];
      if (!in_place) {
        // A second gradient in one backward (a parameter used inside and outside a reentrant
        // checkpoint) is summed, as autograd would have summed it into .grad.
        at::Tensor& held = bucket.grads[pos];
        held = held.defined() ? held + grad : std::move(grad);
      }
      if (!bucket.arrived[pos]) {
        bucket.arrived[pos] = 1;
        if (++bucket.count == (int64_t)bucket.arrived.size()) {
          complete = slot_bucket_[key];
          grads = take(bucket);
          // Once per backward: a second completion (reentrant pieces) is Python's.
          const bool fast = bucket.fast && bucket.folded_task != task &&
                            std::all_of(grads.begin(), grads.end(), [&](const at::Tensor& g) {
                              return g.defined() && g.device() == bucket.acc.device();
                            });
          if (fast) {
            fast_acc = bucket.acc;
            fast_offsets = bucket.offsets;
            fast_overwrite = bucket.overwrite;
            bucket.folded_task = task;
            if (fast_overwrite) {
              overwritten_.push_back(complete);
              revoke(bucket);  // the window's first gradients: the next backward adds
            }
          } else {
            quiet_clean_ = false;
          }
        }
      }
    }
    // Python is called without the lock held: it may call back (arrive_in_place, clear).
    // The first gradient of a backward asks Python to see that backward's end.
    if (new_task) call(queue_end_);
    if (fast_acc.defined()) {
      fold_into(fast_acc, fast_offsets, grads, fast_overwrite);
    } else if (complete >= 0) {
      call(bucket_complete_, complete, std::move(grads));
    }
  }

  static void revoke(BucketArrivals& bucket) {
    bucket.fast = false;
    bucket.folded_task = -1;
    bucket.overwrite = false;
    bucket.acc.reset();
    bucket.offsets.reset();
  }

  static std::vector<at::Tensor> take(BucketArrivals& bucket) {
    std::vector<at::Tensor> grads(bucket.grads.size());
    grads.swap(bucket.grads);
    std::fill(bucket.arrived.begin(), bucket.arrived.end(), 0);
    bucket.count = 0;
    return grads;
  }

  // Calls Python; a Python exception leaves through the autograd engine as torch's own hooks'
  // do (python_error keeps it across threads) and reaches the caller of backward() unchanged.
  template <typename... Args>
  static void call(const py::object& fn, Args&&... args) {
    py::gil_scoped_acquire gil;
    try {
      fn(std::forward<Args>(args)...);
    } catch (py::error_already_set& err) {
      err.restore();
      python_error error;
      error.persist();
      throw error;
    }
  }

  static bool call_bool(const py::object& fn, int64_t key, const at::Tensor& grad) {
    py::gil_scoped_acquire gil;
    try {
      return fn(key, grad).cast<bool>();
    } catch (py::error_already_set& err) {
      err.restore();
      python_error error;
      error.persist();
      throw error;
    }
  }

  std::vector<int64_t> slot_bucket_, slot_position_;
  std::vector<std::string> names_;
  py::object before_backward_, queue_end_, bucket_complete_, fold_hooked_, backward_raised_;
  std::vector<BucketArrivals> buckets_;
  // by slot: the AccumulateGrad nodes we hook. The pointer type is whatever grad_accumulator()
  // returns: std::shared_ptr<Node> up to torch 2.12, c10::intrusive_ptr<Node> from 2.13 on.
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodePtr> nodes_;
  void hook_locked(int64_t key, NodePtr node);  // (with mutex_ held)
  std::vector<at::Tensor> hidden_;  // by slot: the .grad the pre-hook hid, until the post-hook
  std::vector<at::Tensor> shown_;   // by slot: what expose() set .grad to (undefined: nothing)
  std::vector<const void*> shown_data_;  // by slot: where that view's memory was when shown
  std::mutex mutex_;  // autograd runs one thread per device: buckets are filled from several
  int last_task_ = -1;  // the graph task whose end Python was last asked to see
  std::vector<int64_t> overwritten_;  // see take_overwritten
  // Quiet backwards: how many more may run; the backward running quietly (-1: none) and whether
  // it still needs nothing of Python; the last backward the window queued its own end for; how
  // many ended quietly since take_quiet_backwards; the window's counter and its value at arming.
  std::atomic<int64_t> quiet_left_{0};
  int quiet_task_ = -1;
  bool quiet_clean_ = false;
  int python_task_ = -1;
  int64_t quiet_done_ = 0;
  py::object changes_object_;
  const int64_t* changes_ = nullptr;
  int64_t armed_at_ = 0;
};

struct TakeGradBefore : public FunctionPreHook {
  TakeGradBefore(std::weak_ptr<Arrivals> arrivals, AccumulateGrad* node, int64_t key)
      : arrivals(std::move(arrivals)), node(node), key(key) {}
  variable_list operator()(const variable_list& grads) override {
    if (auto table = arrivals.lock()) return table->before_accumulate(key, *node, grads);
    return grads;
  }
  std::weak_ptr<Arrivals> arrivals;
  AccumulateGrad* node;  // owns this hook, so outlives it
  int64_t key;
};

struct TakeGradAfter : public FunctionPostHook {
  TakeGradAfter(std::weak_ptr<Arrivals> arrivals, AccumulateGrad* node, int64_t key)
      : arrivals(std::move(arrivals)), node(node), key(key) {}
  variable_list operator()(const variable_list& outputs, const variable_list& inputs) override {
    // An undefined input: the pre-hook took the gradient (or there was none): nothing to do.
    if (inputs.size() == 1 && inputs[0].defined()) {
      if (auto table = arrivals.lock()) table->after_accumulate(key, node->variable);
    }
    return outputs;
  }
  std::weak_ptr<Arrivals> arrivals;
  AccumulateGrad* node;
  int64_t key;
};

void Arrivals::attach(int64_t key, const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!detached_, "Arrivals.attach: detached");
  TORCH_CHECK(key >= 0 && key < (int64_t)nodes_.size(), "Arrivals.attach: no slot ", key);
  TORCH_CHECK(param.requires_grad() && param.is_leaf(),
              "Arrivals.attach: the parameter must be a leaf that requires grad");
  TORCH_CHECK(!nodes_[key], "Arrivals.attach: slot ", key, " is already hooked");
  NodePtr node = torch::autograd::impl::grad_accumulator(param);
  TORCH_CHECK(dynamic_cast<AccumulateGrad*>(node.get()) != nullptr,
              "Arrivals.attach: the parameter has no AccumulateGrad node");
  hook_locked(key, std::move(node));
}

void Arrivals::hook_locked(int64_t key, NodePtr node) {
  auto* accumulate = static_cast<AccumulateGrad*>(node.get());
  node->add_pre_hook(std::make_unique<TakeGradBefore>(weak_from_this(), accumulate, key));
  node->add_post_hook(std::make_unique<TakeGradAfter>(weak_from_this(), accumulate, key));
  // Tensors hold their AccumulateGrad weakly: a node no graph references is rebuilt, without
  // our hooks, by the next forward. Holding it keeps the hooks (DDP's reducer does the same).
  nodes_[key] = std::move(node);
}

std::vector<int64_t> Arrivals::rehook(const std::vector<at::Tensor>& params) {
  std::vector<int64_t> moved;
  std::lock_guard<std::mutex> lock(mutex_);
  if (detached_) return moved;
  TORCH_CHECK(params.size() == nodes_.size(), "Arrivals.rehook: expected one parameter per slot");
  for (size_t key = 0; key < nodes_.size(); ++key) {
    if (!nodes_[key]) continue;
    const at::Tensor& param = params[key];
    if (!param.requires_grad() || !param.is_leaf()) continue;
    NodePtr now = torch::autograd::impl::grad_accumulator(param);
    if (!now || now.get() == nodes_[key].get() || dynamic_cast<AccumulateGrad*>(now.get()) == nullptr) continue;
    hook_locked(static_cast<int64_t>(key), std::move(now));
    moved.push_back(static_cast<int64_t>(key));
  }
  return moved;
}

// What the Triton backend's launch-plan cache keys a call by (fused_accum/backends/triton/plans.py):
// each tensor's address and dtype, as int64 pairs in one bytes object. Read in one C++ pass:
// Python reads each at ~0.14 us per tensor and attribute, more than the goal for a whole call.
py::bytes addresses_and_dtypes(const std::vector<at::Tensor>& tensors) {
  std::vector<int64_t> out;
  out.reserve(2 * tensors.size());
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.defined(), "addresses_and_dtypes: an undefined tensor");
    out.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    out.push_back(static_cast<int64_t>(t.scalar_type()));
  }
  return py::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
}

}  // namespace
}  // namespace fused_accum

// `import fused_accum._C` loads this library, which also registers the fused_accum_ext:: operators
// (bindings.cpp). The module says whether the CUDA kernels were compiled in (setup.py defines
// FA_WITH_CUDA) and holds the C++ hooks.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using fused_accum::Arrivals;
  m.doc() = "fused_accum's C++/CUDA kernels (as torch.ops.fused_accum_ext.*) and C++ autograd hooks";
  m.attr("built_with_cuda") = FA_WITH_CUDA;
  m.def("addresses_and_dtypes", &fused_accum::addresses_and_dtypes, py::arg("tensors"));
  py::class_<Arrivals, std::shared_ptr<Arrivals>>(m, "Arrivals")
      .def(py::init<py::object, py::object, py::object, py::object, py::object>(), py::arg("before_backward"),
           py::arg("queue_end"), py::arg("bucket_complete"), py::arg("fold_hooked"), py::arg("backward_raised"))
      .def("extend", &Arrivals::extend)
      .def("attach", &Arrivals::attach)
      .def("rehook", &Arrivals::rehook)
      .def("detach_all", &Arrivals::detach_all)
      .def("arrive_in_place", &Arrivals::arrive_in_place)
      .def("take_partial", &Arrivals::take_partial)
      .def("clear", &Arrivals::clear)
      .def("grant_fast", &Arrivals::grant_fast)
      .def("revoke_fast", &Arrivals::revoke_fast)
      .def("take_overwritten", &Arrivals::take_overwritten)
      .def("has_arrivals", &Arrivals::has_arrivals)
      .def("expose", &Arrivals::expose)
      .def("changed", &Arrivals::changed)
      .def("clear_grads", &Arrivals::clear_grads)
      .def("arm_quiet", &Arrivals::arm_quiet)
      .def("take_quiet_backwards", &Arrivals::take_quiet_backwards)
      .def("python_seen", &Arrivals::python_seen)
      .def_property(
          "native", [](Arrivals& a) { return a.native_.load(); },
          [](Arrivals& a, bool v) { a.native_ = v; })
      .def_property(
          "slow", [](Arrivals& a) { return a.slow_.load(); }, [](Arrivals& a, bool v) { a.slow_ = v; })
      .def_property(
          "hide", [](Arrivals& a) { return a.hide_.load(); }, [](Arrivals& a, bool v) { a.hide_ = v; });
}
