// The per-parameter autograd hooks of a gradient window in C++: fused_accum._C.Arrivals (declared
// in hooks.h, bound here: bind_arrivals). What they do for the window, and when they call it, is
// the contract in fused_accum/arrivals.py (HookTable, Plan and Report), which the Python twin
// there keeps too; the comments here say how this table does it.
//
// Why C++: the hooks run once per parameter per backward. As Python callables each costs the
// autograd engine a GIL acquisition and two tensor wraps, several microseconds per parameter, more
// than torch's own `.grad += g`. Here each is a few pointer operations; Python is called once per
// complete bucket and once per backward, and not at all in the middle backwards of a window
// (quiet backwards: the plan's quiet_until).
//
// The hooks are node hooks on each parameter's AccumulateGrad node (which the table keeps alive):
// unlike tensor hooks they live beside, not instead of, the hooks users register from Python
// (assigning a tensor's Python hook dict clears its C++ tensor hooks), and, unlike tensor
// pre-hooks, they run only when AccumulateGrad runs (not for torch.autograd.grad's captures).
#include "hooks.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <utility>
#include <tuple>

namespace fused_accum {
namespace {

using torch::autograd::AccumulateGrad;
using torch::autograd::FunctionPostHook;
using torch::autograd::FunctionPreHook;
using torch::autograd::variable_list;
using torch::dynamo::autograd::CompiledNodeArgs;

// fused_accum_ext::accumulate_ (bindings.cpp), through the dispatcher: CPU or CUDA by device.
void fold_into(const at::Tensor& acc, const at::Tensor& offsets, at::TensorList grads, bool overwrite) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fused_accum_ext::accumulate_", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, at::TensorList, double, bool,
                                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
  at::NoGradGuard no_grad;  // (a double backward runs the hooks in grad mode: the sums keep no graph)
  op.call(acc, offsets, grads, 1.0, overwrite, std::nullopt, std::nullopt);
}

// A grant's tensors were handed by Python (the window's plan), so dropping the last reference to
// one may take the GIL (torch gives a tensor's Python object back to Python then). A caller that
// holds the table's lock without the GIL (an autograd thread in arrive) passes `dropped`, and
// lets those references go after it unlocked: another thread, holding the GIL, may be waiting on
// that lock (Folder.take_report -> report).
void ungrant(BucketArrivals& bucket, std::vector<at::Tensor>* dropped = nullptr) {
  bucket.fast = bucket.overwrite = false;
  if (dropped != nullptr) {
    dropped->push_back(std::move(bucket.acc));
    dropped->push_back(std::move(bucket.offsets));
  }
  bucket.acc.reset();
  bucket.offsets.reset();
}

void revoke(BucketArrivals& bucket, std::vector<at::Tensor>* dropped = nullptr) {
  ungrant(bucket, dropped);
  bucket.folded_task = -1;
}

// Whether the fold of `grads` into `acc` stays in C++: it runs under the table's lock, so it
// may not enter Python (a dispatch mode, a tensor subclass), which another thread, holding the
// GIL, may be waiting on that lock for.
bool folds_in_cpp(const at::Tensor& acc, const std::vector<at::Tensor>& grads) {
  if (c10::impl::dispatch_mode_enabled()) return false;
  return std::all_of(grads.begin(), grads.end(), [&](const at::Tensor& g) {
    return g.defined() && g.device() == acc.device() && !g.key_set().has(c10::DispatchKey::Python);
  });
}

std::vector<at::Tensor> take(BucketArrivals& bucket) {
  std::vector<at::Tensor> grads(bucket.grads.size());
  grads.swap(bucket.grads);
  std::fill(bucket.arrived.begin(), bucket.arrived.end(), 0);
  bucket.count = 0;
  return grads;
}

bool any_arrivals(const std::vector<BucketArrivals>& buckets) {
  return std::any_of(buckets.begin(), buckets.end(), [](const BucketArrivals& b) { return b.count; });
}

// Calls Python; a Python exception leaves through the autograd engine as torch's own hooks'
// do (python_error keeps it across threads) and reaches the caller of backward() unchanged.
template <typename... Args>
void call(const py::object& fn, Args&&... args) {
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

template <typename... Args>
py::object call_python(const py::object& fn, Args&&... args) {
  py::gil_scoped_acquire gil;
  try {
    return fn(std::forward<Args>(args)...);
  } catch (py::error_already_set& err) {
    err.restore();
    python_error error;
    error.persist();
    throw error;
  }
}

bool call_bool(const py::object& fn, int64_t key, const at::Tensor& grad) {
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

// The two hooks on a node. They hold the table weakly: a freed table leaves them inert.
struct TakeGradBefore : public FunctionPreHook {
  TakeGradBefore(std::weak_ptr<Arrivals> arrivals, AccumulateGrad* node, int64_t key)
      : arrivals(std::move(arrivals)), node(node), key(key) {}
  variable_list operator()(const variable_list& grads) override {
    if (auto table = arrivals.lock()) return table->before_accumulate(key, *node, grads);
    return grads;
  }
  // Compiled autograd calls this instead, once per backward it captures, before its graph runs.
  void compiled_args(CompiledNodeArgs& args) const override {
    if (auto table = arrivals.lock()) table->compiled_pre_hook(key, *node, args);
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
      if (auto table = arrivals.lock()) table->after_accumulate(key, *node);
    }
    return outputs;
  }
  // In a compiled graph: `.grad` = the slot's view (see Arrivals::compiled_pre_hook).
  void compiled_args(CompiledNodeArgs& args) const override {
    if (auto table = arrivals.lock()) table->compiled_post_hook(key, args);
  }
  std::weak_ptr<Arrivals> arrivals;
  AccumulateGrad* node;
  int64_t key;
};

// The user's hooks on a parameter's AccumulateGrad node, beside the tables' own (registered with
// its grad_fn's register_prehook / register_hook: the overlapped all-reduce of Megatron and
// DeepSpeed): `pre`, a pre-hook that runs after ours, which must be handed the gradient (it is
// left to AccumulateGrad); `post`, a post-hook, which reads .grad as the running sum (folded at
// once). (Most nodes hold only our two hooks: the sizes say so without a look at each.)
struct UserHooks {
  bool pre = false, post = false;
};

UserHooks user_hooks(const AccumulateGrad& node) {
  UserHooks user;
  if (node.pre_hooks().size() > 1) {
    bool ours = false;
    for (const auto& hook : node.pre_hooks()) {
      const bool table = dynamic_cast<const TakeGradBefore*>(hook.get()) != nullptr;
      user.pre |= ours && !table;
      ours |= table;
    }
  }
  if (node.post_hooks().size() > 1) {
    for (const auto& hook : node.post_hooks()) user.post |= dynamic_cast<const TakeGradAfter*>(hook.get()) == nullptr;
  }
  return user;
}

}  // namespace

Arrivals::Arrivals(py::object before_backward, py::object queue_end, py::object bucket_complete,
                   py::object fold_hooked, py::object backward_raised)
    : before_backward_(std::move(before_backward)),
      queue_end_(std::move(queue_end)),
      bucket_complete_(std::move(bucket_complete)),
      fold_hooked_(std::move(fold_hooked)),
      backward_raised_(std::move(backward_raised)) {}

// Usually run by Python, with the GIL. A hook that outlived the window's last Python
// reference may run it on an autograd thread, without the GIL that releasing Python objects
// needs. The hooks are not removed here (this may be inside one of them): they go inert.
Arrivals::~Arrivals() {
  py::gil_scoped_acquire gil;
  counters_object_ = py::object();
  types_ = py::object();
  before_backward_ = py::object();
  queue_end_ = py::object();
  bucket_complete_ = py::object();
  fold_hooked_ = py::object();
  backward_raised_ = py::object();
  compiled_backward_ = py::object();
  compiled_first_ = py::object();
  compiled_folds_.clear();
}

void Arrivals::extend(const std::vector<int64_t>& bucket_sizes, const std::vector<int64_t>& slot_bucket,
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
    TORCH_CHECK(b >= 0 && b < (int64_t)buckets_.size() && pos >= 0 && pos < (int64_t)buckets_[b].grads.size(),
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

// One pass over the parameters, as a fused_accum.arrivals.Look: first the slots whose parameter
// has another AccumulateGrad node than the one hooked, hooked again (asking grad_accumulator() for
// a parameter whose `.data` changed device or dtype builds the new node now; autograd would at the
// next forward, which then uses this one), then the keys whose `.grad` is not what was shown.
py::object Arrivals::look(const std::vector<at::Tensor>& params) {
  if (!types_) types_ = py::module_::import("fused_accum.arrivals");
  std::vector<int64_t> moved, changed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!detached_) {
      TORCH_CHECK(params.size() == nodes_.size(), "Arrivals.look: expected one parameter per slot");
      for (size_t key = 0; key < nodes_.size(); ++key) {
        if (!nodes_[key]) continue;
        const at::Tensor& param = params[key];
        if (!param.requires_grad() || !param.is_leaf()) continue;
        NodePtr now = torch::autograd::impl::grad_accumulator(param);
        if (!now || now.get() == nodes_[key].get() || dynamic_cast<AccumulateGrad*>(now.get()) == nullptr) continue;
        hook_locked(static_cast<int64_t>(key), std::move(now));
        moved.push_back(static_cast<int64_t>(key));
      }
    }
    changed = changed_locked(false);
  }
  return types_.attr("Look")(py::tuple(py::cast(moved)), py::tuple(py::cast(changed)));
}

// The hooks are not removed from the nodes: this may run inside one of them.
void Arrivals::detach_all() {
  detached_ = true;
  std::lock_guard<std::mutex> lock(mutex_);
  nodes_.clear();
}

// The pre-hook. Handing AccumulateGrad an undefined gradient makes the node skip it: `.grad` is
// not touched, and autograd neither detaches nor stores anything (a user's post-accumulate-grad
// hook and the node's post-hooks still run: they see .grad as the running sum, folded at once by
// the window). AccumulateGrad must run where it does more than store the gradient: a double
// backward keeps the gradient's graph, a non-strided or zero tensor needs its handling, a
// parameter that no longer requires grad drops it, a user's pre-hook after ours must see it (and
// the window may decline a hooked one).
variable_list Arrivals::before_accumulate(int64_t key, AccumulateGrad& node, const variable_list& grads) {
  if (standing_aside()) return grads;
  if (slow_) {
    if (!start_quietly()) call(before_backward_);
    if (standing_aside()) return grads;
  }
  if (grads.size() != 1 || !grads[0].defined()) return grads;
  const at::Tensor& param = node.variable;
  const at::Tensor& grad = grads[0];
  const bool plain =
      grad.layout() == at::kStrided && !grad._is_zerotensor() && param.requires_grad() && !at::GradMode::is_enabled();
  const UserHooks user = user_hooks(node);
  if (plain && !user.pre) {
    if (!user.post && !node.tensor_post_acc_grad_hooks()) {
      arrive(key, grad);
      return variable_list(1);
    }
    if (call_bool(fold_hooked_, key, grad)) return variable_list(1);
  }
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
// which the bucket's fold brings up to date; or at once, for the user's post-hooks after ours).
void Arrivals::after_accumulate(int64_t key, AccumulateGrad& node) {
  if (standing_aside()) return;
  const at::Tensor& param = node.variable;
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
  if (user_hooks(node).post && call_bool(fold_hooked_, key, grad)) return;
  arrive(key, std::move(grad));
}

void Arrivals::arrive_in_place(int64_t key) { arrive(key, at::Tensor()); }

// One lock per arrival (the hot path). An undefined `grad`: the slot was written in place.
void Arrivals::arrive(int64_t key, at::Tensor grad) {
  const bool in_place = !grad.defined();
  const int task = in_place ? -1 : torch::autograd::get_current_graph_task_id();
  bool new_task = false;
  int64_t complete = -1;
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> dropped;  // (a grant's tensors, let go once unlocked: see ungrant)
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
      if (held.defined()) {
        at::Tensor sum = held + grad;
        dropped.push_back(std::exchange(held, std::move(sum)));  // (a user's hook may have made it in Python)
      } else {
        held = std::move(grad);
      }
    }
    if (!bucket.arrived[pos]) {
      bucket.arrived[pos] = 1;
      if (++bucket.count == (int64_t)bucket.arrived.size()) {
        complete = slot_bucket_[key];
        grads = take(bucket);
        // Once per backward: a second completion (reentrant pieces) is Python's.
        if (bucket.fast && bucket.folded_task != task && folds_in_cpp(bucket.acc, grads)) {
          // Folded under the lock, with the grant it was decided by: another thread's backward
          // of the same model folds this bucket after it, not at once (an add lost), and a
          // report that names an overwrite is taken after its sums are written.
          fold_into(bucket.acc, bucket.offsets, grads, bucket.overwrite);
          bucket.folded_task = task;
          if (bucket.overwrite) {
            overwritten_.push_back(complete);
            revoke(bucket, &dropped);  // the window's first gradients: the next backward adds
          }
          complete = -1;
        } else {
          quiet_clean_ = false;
          ungrant(bucket, &dropped);  // (the window folds these: a fold of the grant's would race it)
          bucket.with_window = true;
        }
      }
    }
  }
  const auto folded = c10::make_scope_exit([&] {  // (however the calls below end)
    if (complete < 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    buckets_[complete].with_window = false;
  });
  // Python is called without the lock held: it may call back (arrive_in_place, clear).
  // The first gradient of a backward asks Python to see that backward's end.
  if (new_task) call(queue_end_);
  if (complete >= 0) call(bucket_complete_, complete, std::move(grads));
}

void Arrivals::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& bucket : buckets_) {
    take(bucket);
    revoke(bucket);
  }
  for (auto& grad : hidden_) grad.reset();
  overwritten_.clear();
  last_task_ = -1;
  armed_ = false;
  quiet_until_ = 0;
  quiet_clean_ = false;  // (a quiet backward still running hands its end to Python)
}

// `.grad` = views[key] where held[key], else undefined where it was that view (hand's `show`):
// here because it touches every parameter. The view's data pointer is kept too, for
// changed_locked().
void Arrivals::expose_locked(const std::vector<std::optional<at::Tensor>>& views, const std::vector<bool>& held) {
  if (detached_) return;  // (the nodes are let go)
  TORCH_CHECK(views.size() == nodes_.size() && held.size() == nodes_.size(),
              "Arrivals.hand: show must be one view and one flag per slot");
  for (size_t key = 0; key < nodes_.size(); ++key) {
    if (!nodes_[key]) continue;
    at::Tensor& grad = param_of(key).mutable_grad();
    const at::Tensor view = views[key].value_or(at::Tensor());
    if (held[key] && view.defined()) {
      if (!grad.is_same(view)) grad = view;
      shown_[key] = view;
      shown_data_[key] = view.const_data_ptr();
    } else {
      if (view.defined() && grad.is_same(view)) grad.reset();
      shown_[key].reset();
    }
  }
}

bool Arrivals::clear_grads() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (detached_) return false;  // (the nodes are let go)
  for (size_t key = 0; key < nodes_.size(); ++key) {
    if (nodes_[key]) param_of(key).mutable_grad().reset();
    shown_[key].reset();
  }
  return true;
}

// The keys whose `.grad` is not what was last shown; with `any`, stops at the first.
std::vector<int64_t> Arrivals::changed_locked(bool any) {
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

bool Arrivals::has_arrivals() {
  std::lock_guard<std::mutex> lock(mutex_);
  return any_arrivals(buckets_);
}

// The parameter of a hooked slot (its AccumulateGrad node holds it).
const at::Tensor& Arrivals::param_of(size_t key) const {
  return static_cast<const AccumulateGrad*>(nodes_[key].get())->variable;
}

// --- the plan and the report ---

// The plan's fields, read from fused_accum.arrivals.Plan (and its Grant tuples), then set under
// the lock: the grants replace every bucket's (the backward a grant last folded is kept: a second
// completion in that backward stays Python's), less those the window decided before it took back
// what the hooks did (a bucket in bucket_complete; an overwrite used since the last report: a
// plan handed in a callback of another thread's backward, or of a nested one, would otherwise
// grant it again, and the next gradients would be written over the first); seen, a backward the
// window now ends itself, is not quiet; `slow` is applied where it changed (a backward running
// quietly keeps the pre-hook fast). With `show` (views, held), `.grad` shows the window first
// (expose_locked), in the same lock.
void Arrivals::hand(const py::object& plan, const py::object& show) {
  const bool stands_aside = plan.attr("stands_aside").cast<bool>();
  const bool slow = plan.attr("slow").cast<bool>();
  const bool hide = plan.attr("hide").cast<bool>();
  const int seen = plan.attr("seen").cast<int>();
  const int64_t quiet_until = plan.attr("quiet_until").cast<int64_t>();
  const int64_t at = plan.attr("at").cast<int64_t>();
  std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, bool>> grants;
  for (const py::handle grant : plan.attr("grants")) {
    const auto fields = py::reinterpret_borrow<py::tuple>(grant);
    TORCH_CHECK(fields.size() == 4, "Arrivals.hand: a grant is (bucket, acc, offsets, overwrite)");
    grants.emplace_back(fields[0].cast<int64_t>(), fields[1].cast<at::Tensor>(), fields[2].cast<at::Tensor>(),
                        fields[3].cast<bool>());
  }
  py::object counters_object = plan.attr("counters");
  int64_t* counters = nullptr;
  if (!counters_object.is_none()) {
    const py::buffer_info info = counters_object.cast<py::buffer>().request(true);
    TORCH_CHECK(info.itemsize == sizeof(int64_t) && info.size == 2 &&
                    info.format == py::format_descriptor<int64_t>::format(),
                "Arrivals.hand: counters must be two int64 (array('q'))");
    counters = static_cast<int64_t*>(info.ptr);
  }
  TORCH_CHECK(quiet_until <= 0 || counters != nullptr, "Arrivals.hand: quiet backwards need the counters");
  std::optional<std::pair<std::vector<std::optional<at::Tensor>>, std::vector<bool>>> exposure;
  if (!show.is_none()) {
    exposure = show.cast<std::pair<std::vector<std::optional<at::Tensor>>, std::vector<bool>>>();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (exposure) expose_locked(exposure->first, exposure->second);
  for (const auto& grant : grants) {
    const int64_t b = std::get<0>(grant);
    TORCH_CHECK(b >= 0 && b < (int64_t)buckets_.size(), "Arrivals.hand: no bucket ", b);
  }
  for (auto& bucket : buckets_) ungrant(bucket);
  for (auto& grant : grants) {
    const int64_t b = std::get<0>(grant);
    BucketArrivals& bucket = buckets_[b];
    if (bucket.with_window ||
        (std::get<3>(grant) && std::find(overwritten_.begin(), overwritten_.end(), b) != overwritten_.end())) {
      continue;
    }
    bucket.fast = true;
    bucket.acc = std::move(std::get<1>(grant));
    bucket.offsets = std::move(std::get<2>(grant));
    bucket.overwrite = std::get<3>(grant);
  }
  stands_aside_ = stands_aside;
  hide_ = hide;
  if (seen != python_task_) {
    python_task_ = seen;
    quiet_clean_ = false;  // (the window queued that backward's end: it is not quiet)
  }
  if (slow != slow_planned_) {
    slow_planned_ = slow;
    slow_ = slow;
  }
  counters_object_ = std::move(counters_object);  // (keeps the buffer alive)
  counters_ = counters;
  at_ = at;
  quiet_until_ = quiet_until;
  armed_ = counters_ != nullptr && counters_[1] < quiet_until_;
}

// The plan in force, as a fused_accum.arrivals.Plan: the last one handed, less the overwrite
// grants used since and the quiet backwards a failed check called off.
py::object Arrivals::plan() {
  if (!types_) types_ = py::module_::import("fused_accum.arrivals");
  std::vector<std::tuple<size_t, at::Tensor, at::Tensor, bool>> grants;
  bool armed;
  int seen;
  int64_t quiet_until, at;
  py::object counters;
  {
    std::lock_guard<std::mutex> lock(mutex_);  // (no Python under it: it might call back in)
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const BucketArrivals& bucket = buckets_[b];
      if (bucket.fast) grants.emplace_back(b, bucket.acc, bucket.offsets, bucket.overwrite);
    }
    armed = armed_;
    seen = python_task_;
    quiet_until = quiet_until_;
    at = at_;
    counters = counters_object_;
  }
  py::tuple out(grants.size());
  for (size_t i = 0; i < grants.size(); ++i) {
    const auto& [b, acc, offsets, overwrite] = grants[i];
    out[i] = types_.attr("Grant")(b, acc, offsets, overwrite);
  }
  return types_.attr("Plan")(stands_aside_.load(), slow_planned_, hide_.load(), seen, out, armed ? quiet_until : 0,
                             counters ? counters : py::none(), at);
}

// What the hooks did since the last report, as a fused_accum.arrivals.Report.
py::object Arrivals::report(bool end) {
  if (!types_) types_ = py::module_::import("fused_accum.arrivals");
  std::vector<int64_t> overwritten;
  std::vector<std::pair<int64_t, std::vector<at::Tensor>>> partial;
  int64_t quiet;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    overwritten.swap(overwritten_);
    if (end) {
      for (size_t b = 0; b < buckets_.size(); ++b) {
        if (!buckets_[b].count) continue;
        partial.emplace_back(b, take(buckets_[b]));
        ungrant(buckets_[b]);  // (the window folds these: a fold of the grant's would race it)
      }
    }
    quiet = counters_ ? counters_[1] : 0;
  }
  py::tuple partial_out(partial.size());
  for (size_t i = 0; i < partial.size(); ++i) {
    partial_out[i] = py::make_tuple(partial[i].first, py::cast(std::move(partial[i].second)));
  }
  return types_.attr("Report")(py::tuple(py::cast(overwritten)), partial_out, quiet);
}

// --- the fast path: quiet backwards ---

// Holds the end callback of a quiet backward: destroyed unrun, the backward raised.
struct Arrivals::QuietEnd {
  QuietEnd(std::weak_ptr<Arrivals> table, int task) : table(std::move(table)), task(task) {}
  ~QuietEnd() {
    if (ran) return;
    if (auto arrivals = table.lock()) arrivals->raised_quietly(task);
  }
  std::weak_ptr<Arrivals> table;
  int task;
  bool ran = false;
};

// At the first gradient of a backward (while `slow_`): true if it runs quietly, having checked
// here what the window's before_backward would (nothing it decided from changed, no `.grad`
// the user changed, nothing left over from a backward that raised, not a double backward); it
// then sees its own end (end_quietly). False: the window's before_backward is to run.
bool Arrivals::start_quietly() {
  if (!armed_ || at::GradMode::is_enabled()) return false;
  const int task = torch::autograd::get_current_graph_task_id();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!slow_) return true;  // (another device's thread started this backward quietly)
    const bool ready = armed_ && counters_[0] == at_ && task != python_task_ && overwritten_.empty() &&
                       !any_arrivals(buckets_) && changed_locked(true).empty();
    if (!ready) {
      armed_ = false;  // (the window plans again at the end of the backward it runs)
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

// A backward started quietly raised before its end. Unless the window saw it (then its own
// end callback, dropped too, tells it), hand the window what arrived: backward_raised().
void Arrivals::raised_quietly(int task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (task != quiet_task_) return;
    quiet_task_ = -1;
    armed_ = false;
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
void Arrivals::end_quietly(int task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (standing_aside() || task != quiet_task_) return;
    quiet_task_ = -1;
    slow_ = slow_planned_;  // (false while the backward ran quietly: the plan's again)
    if (task == python_task_) return;  // the window's own end callback ends it
    const bool quiet = quiet_clean_ && !torch::autograd::get_current_node() && !any_arrivals(buckets_);
    if (quiet) {
      ++counters_[1];
      armed_ = counters_[1] < quiet_until_;
      return;
    }
    armed_ = false;
  }
  call(queue_end_);
}

// --- compiled autograd ---

void Arrivals::compile_with(py::object compiled_backward, py::object compiled_first) {
  compiled_backward_ = std::move(compiled_backward);
  compiled_first_ = std::move(compiled_first);
}

// Compiled autograd does not run the hooks: it asks each node's hooks what to put in the graph it
// captures (compiled_args), once per backward, before that graph runs (a cache hit included),
// then runs the graph. At the first hooked parameter of a backward the window's checks run and
// its count goes up (compiled_backward, once per backward: what before_backward and the end
// callback do in eager; no end callback runs under compiled autograd, which drops the engine's
// queued callbacks). Each parameter's node then gets two Python hooks that Dynamo traces into
// the graph: before AccumulateGrad the window's fold (the custom op fused_accum::accumulate_
// into the slot's fp32 view; AccumulateGrad is handed no gradient), after it `.grad` = that view
// (AccumulateGrad, next in the graph, sets `.grad` from what it read before the graph: hidden
// here, None, for a bf16 parameter's fp32 `.grad` cannot be captured, as FakeTensor would make
// it). A slot without a gradient in the window is asked for once (compiled_first: it is
// recorded as holding one, and overwritten).
void Arrivals::compiled_pre_hook(int64_t key, AccumulateGrad& node, CompiledNodeArgs& args) {
  if (detached_) return;
  py::gil_scoped_acquire gil;  // (compiled autograd holds it: a no-op)
  TORCH_CHECK(compiled_backward_, "Arrivals: compiled autograd needs the window's callbacks (compile_with)");
  const int task = torch::autograd::get_current_graph_task_id();
  if (task != compiled_task_) {
    compiled_folds_.clear();
    const py::object folds = call_python(compiled_backward_);
    compiled_task_ = task;
    for (const py::handle fold : folds) compiled_folds_.push_back(py::reinterpret_borrow<py::object>(fold));
  }
  if (standing_aside()) return;
  TORCH_CHECK(!node.tensor_post_acc_grad_hooks(), "parameter ", names_.at(key),
              " has a post-accumulate-grad hook: under compiled autograd it would run before fused_accum shows the "
              "window's running sum in .grad; run this backward without compiled autograd");
  TORCH_CHECK(key >= 0 && key < (int64_t)compiled_folds_.size(), "Arrivals: no compiled fold for slot ", key);
  py::object& fold = compiled_folds_[key];
  if (fold.is_none()) fold = call_python(compiled_first_, key);
  const auto parts = fold.cast<std::tuple<py::object, py::object, at::Tensor>>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    node.variable.mutable_grad().reset();
    shown_[key] = std::get<2>(parts);  // (what the graph's post-hook shows)
    shown_data_[key] = std::get<2>(parts).const_data_ptr();
  }
  // (a new reference, which the SafePyObject owns)
  args.add_pre_hook(c10::SafePyObject(std::get<0>(parts).inc_ref().ptr(), ::getPyInterpreter()));
}

// After compiled_pre_hook, for the same node: the post-hook that shows the view in `.grad`.
void Arrivals::compiled_post_hook(int64_t key, CompiledNodeArgs& args) {
  if (detached_ || standing_aside()) return;
  py::gil_scoped_acquire gil;
  TORCH_CHECK(key >= 0 && key < (int64_t)compiled_folds_.size() && !compiled_folds_[key].is_none(),
              "Arrivals: the compiled post-hook of slot ", key, " came before its pre-hook");
  const auto parts = compiled_folds_[key].cast<std::tuple<py::object, py::object, at::Tensor>>();
  args.add_post_hook(c10::SafePyObject(std::get<1>(parts).inc_ref().ptr(), ::getPyInterpreter()));
}

void bind_arrivals(py::module_& m) {
  py::class_<Arrivals, std::shared_ptr<Arrivals>>(m, "Arrivals")
      .def(py::init<py::object, py::object, py::object, py::object, py::object>(), py::arg("before_backward"),
           py::arg("queue_end"), py::arg("bucket_complete"), py::arg("fold_hooked"), py::arg("backward_raised"))
      .def_property_readonly_static("fast", [](py::object) { return true; })
      .def("hand", &Arrivals::hand, py::arg("plan"), py::arg("show") = py::none())
      .def_property_readonly("plan", &Arrivals::plan)
      .def("report", &Arrivals::report, py::arg("end"))
      .def("extend", &Arrivals::extend)
      .def("attach", &Arrivals::attach)
      .def("look", &Arrivals::look, py::arg("params"))
      .def("detach_all", &Arrivals::detach_all)
      .def("arrive_in_place", &Arrivals::arrive_in_place)
      .def("clear", &Arrivals::clear)
      .def("has_arrivals", &Arrivals::has_arrivals)
      .def("clear_grads", &Arrivals::clear_grads)
      .def("compile_with", &Arrivals::compile_with, py::arg("compiled_backward"), py::arg("compiled_first"));
}

}  // namespace fused_accum
