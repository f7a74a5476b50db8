"""Compiled autograd with the optimizer's hooks, and the compiled paths that bypass them.

Compiled autograd (``torch._dynamo.compiled_autograd._enable(compiler)`` around ``backward()``,
or ``torch._dynamo.config.compiled_autograd = True`` with a compiled function that calls it)
runs no autograd hook: it asks each node's hooks what to put in the backward graph it captures.
The C++ pre-hook answers with the window's fold (the custom op ``fused_accum::accumulate_`` into
the slot's fp32 view) and a post-hook that shows that view in ``.grad``; the window's checks and
count run as the graph is captured (fused_accum.arrivals.HookTable.compile_with). The oracle is
the same optimizer running the same loop eagerly, bit for bit under ``aot_eager`` (the same aten
ops and the same kernels), weights and optimizer state; after the first window no graph is
compiled again.

A backward traced into a compiled function (``torch._dynamo.config.trace_autograd_ops``) runs
no hook at all: it writes ``.grad`` itself, in the parameter's dtype. The optimizer refuses to
take such low-precision sums (tests at the end).

Compile tests are slow: tiny models, three windows of two micro-batches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo import compiled_autograd

import fused_accum
from fused_accum import nn as fused_nn
from helpers import data, mse  # tests/helpers.py

ACCUM, WINDOWS = 2, 3
LR = 1e-2


@pytest.fixture(autouse=True)
def fresh_dynamo(one_thread):
    torch._dynamo.reset()  # (no graph, guard or compiled autograd cache of another test reused)
    yield
    torch._dynamo.reset()


class Compiles:
    """An aot_eager backend that counts the graphs Dynamo hands it (a recompile is one more)."""

    def __init__(self) -> None:
        self.graphs: list = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    def ops(self, name: str) -> int:
        """How many calls of the custom op ``fused_accum::<name>`` the graphs hold."""
        return sum(str(n.target).startswith(f"fused_accum.{name}") for gm in self.graphs for n in gm.graph.nodes)


class Net(nn.Module):
    def __init__(self, dtype, linear=nn.Linear):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = linear(6, 16), linear(16, 3)
        self.to(dtype)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


# mode -> (parameter dtype, optimizer keywords, step keywords)
MODES = {
    "fp32": (torch.float32, {}, {}),
    "bf16_fp32_masters": (torch.bfloat16, dict(master_weights=True), {}),
    "bf16_remainder": (torch.bfloat16, dict(master_weights="remainder"), {}),
    "max_grad_norm": (torch.bfloat16, dict(master_weights=True, max_grad_norm=0.05), {}),
    "skip_nonfinite": (torch.float32, dict(skip_nonfinite=True), {}),
    "num_items": (torch.float32, {}, dict(num_items=7)),
    "grad_scaler": (torch.float32, {}, {}),
    "step_in_backward": (torch.float32, dict(step_in_backward=True, accum_steps=ACCUM), {}),
}


def _batches(dtype, nonfinite: bool):
    batches = data(ACCUM * WINDOWS, dtype=dtype)
    if nonfinite:  # the second window holds an inf: skip_nonfinite skips its step
        x, y = batches[ACCUM]
        batches[ACCUM] = (x, torch.full_like(y, float("inf")))
    return batches


def _train(mode: str, backward, linear=nn.Linear, compile_step=False):
    """Three windows of ACCUM micro-batches, each loss through ``backward(loss)``, each window
    with its own lr; returns the parameters, every optimizer state tensor, and how many graphs
    ``backward`` compiled by the end of each window. ``compile_step``: the step is
    ``torch.compile(opt.step, fullgraph=True)``, compiled with ``backward``'s backend."""
    dtype, kwargs, step_kwargs = MODES[mode]
    model = Net(dtype, linear)
    opt = fused_accum.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **kwargs)
    step = torch.compile(opt.step, backend=backward.compiles, fullgraph=True) if compile_step else opt.step
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if mode == "grad_scaler" else None
    batches, counts = _batches(dtype, mode == "skip_nonfinite"), []
    for w in range(WINDOWS):
        opt.param_groups[0]["lr"] = LR * (1 - 0.25 * w)  # (a compiled step reads it from a tensor)
        for x, y in batches[w * ACCUM : (w + 1) * ACCUM]:
            loss = mse(model, x, y).float()
            backward(scaler.scale(loss) if scaler else loss)
        assert opt.microbatches == ACCUM
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            step(**step_kwargs)
        opt.zero_grad()
        counts.append(len(getattr(backward, "compiles", Compiles()).graphs))
    state = [t.clone() for p in model.parameters() for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in model.parameters()], state, counts


def _eager(loss):
    loss.backward()


def _compiled_autograd():
    """``backward`` under compiled autograd, its graphs compiled by Dynamo with aot_eager."""
    compiles = Compiles()

    def backward(loss):
        with compiled_autograd._enable(torch.compile(backend=compiles, fullgraph=True)):
            loss.backward()

    backward.compiles = compiles
    return backward


def _assert_equal(got, want, what):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: tensor {i} differs (max {(a.double() - b.double()).abs().max():.3g})"


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_autograd_trains_bit_for_bit_as_eager(mode, hooks):
    """Before: NotImplementedError: compiled_args nyi ... TakeGradBefore at the first backward."""
    if hooks == "python":
        with pytest.raises(RuntimeError, match="fused_accum's C\\+\\+ hooks"):
            _train(mode, _compiled_autograd())
        return
    params, state, _ = _train(mode, _eager)
    backward = _compiled_autograd()
    compiled_params, compiled_state, counts = _train(mode, backward)
    _assert_equal(compiled_params, params, f"{mode}: parameters")
    _assert_equal(compiled_state, state, f"{mode}: optimizer state")
    assert counts[-1] == counts[0], f"{mode}: graphs compiled by the end of each window: {counts}"
    assert backward.compiles.ops("accumulate_") > 0  # the folds are in the captured graph


@pytest.mark.parametrize(
    "mode", ["fp32", "bf16_fp32_masters", "bf16_remainder", "max_grad_norm", "skip_nonfinite", "num_items"]
)
def test_compiled_autograd_with_a_compiled_step_trains_bit_for_bit_as_eager(mode):
    """The two levels together: the backwards captured by compiled autograd, the step
    ``torch.compile(opt.step, fullgraph=True)`` (after such a backward ``.grad`` shows the
    window's fp32 views, as after an eager one: the step writes through the slots' aliases).
    GradScaler and step_in_backward step eagerly (test_compiled_window: what stays eager)."""
    params, state, _ = _train(mode, _eager)
    backward = _compiled_autograd()
    compiled_params, compiled_state, counts = _train(mode, backward, compile_step=True)
    _assert_equal(compiled_params, params, f"{mode}: parameters")
    _assert_equal(compiled_state, state, f"{mode}: optimizer state")
    assert counts[-1] == counts[0], f"{mode}: graphs compiled by the end of each window: {counts}"
    assert backward.compiles.ops("accumulate_") > 0 and backward.compiles.ops("adam_step_") == 1


def test_compiled_autograd_turned_on_by_the_config_with_a_compiled_micro_step(hooks):
    """torch._dynamo.config.compiled_autograd = True: a compiled function's backward is captured
    with that function's backend."""
    if hooks == "python":
        pytest.skip("the Python hooks refuse compiled autograd (test_compiled_autograd_trains_...)")
    params, state, _ = _train("bf16_fp32_masters", _eager)
    compiles = Compiles()
    with torch._dynamo.config.patch(compiled_autograd=True):  # (read as torch.compile wraps the function)
        backward = torch.compile(lambda loss: loss.backward(), backend=compiles)
        backward.compiles = compiles
        compiled_params, compiled_state, counts = _train("bf16_fp32_masters", backward)
    _assert_equal(compiled_params, params, "parameters")
    _assert_equal(compiled_state, state, "optimizer state")
    assert counts[-1] == counts[0], f"graphs compiled by the end of each window: {counts}"
    assert compiles.ops("accumulate_") > 0


def test_grad_shows_the_running_sum_after_each_compiled_backward(hooks):
    if hooks == "python":
        pytest.skip("the Python hooks refuse compiled autograd")
    model = Net(torch.bfloat16)
    opt = fused_accum.SGD(model.parameters(), lr=LR, master_weights=True)
    backward = _compiled_autograd()
    batches = data(3, dtype=torch.bfloat16)
    total = [torch.zeros(p.shape) for p in model.parameters()]
    for x, y in batches:
        grads = torch.autograd.grad(mse(model, x, y).float(), list(model.parameters()))
        total = [t + g.float() for t, g in zip(total, grads)]  # (fp32 sums of the bf16 gradients)
        backward(mse(model, x, y).float())
        for p, t in zip(model.parameters(), total):
            assert p.grad is opt.accumulated_grad(p) and torch.equal(p.grad, t)
    assert opt.microbatches == 3


def test_a_converted_linear_under_compiled_autograd_trains_as_nn_linear(hooks):
    """fused_accum.nn.Linear's captured backward returns the ordinary weight gradient (the
    window's in-place choice is per backward; a captured graph is replayed), which the hook
    folds: bit for bit an nn.Linear model's training."""
    if hooks == "python":
        pytest.skip("the Python hooks refuse compiled autograd")
    params, state, _ = _train("bf16_fp32_masters", _eager)
    compiled_params, compiled_state, _ = _train("bf16_fp32_masters", _compiled_autograd(), linear=fused_nn.Linear)
    _assert_equal(compiled_params, params, "parameters")
    _assert_equal(compiled_state, state, "optimizer state")


def test_offload_is_refused_under_compiled_autograd(hooks):
    if hooks == "python":
        pytest.skip("the Python hooks refuse compiled autograd first")
    model = Net(torch.float32)
    opt = fused_accum.AdamW(model.parameters(), lr=LR, offload="cpu")  # noqa: F841 (alive: its hooks act)
    ((x, y),) = data(1)
    with pytest.raises(RuntimeError, match="offload='cpu'.*without compiled autograd"):
        _compiled_autograd()(mse(model, x, y))


def test_a_post_accumulate_grad_hook_is_refused_under_compiled_autograd(hooks):
    if hooks == "python":
        pytest.skip("the Python hooks refuse compiled autograd first")
    model = Net(torch.float32)
    opt = fused_accum.AdamW(model.parameters(), lr=LR)  # noqa: F841 (alive: its hooks act)
    model.head.bias.register_post_accumulate_grad_hook(lambda p: None)
    ((x, y),) = data(1)
    with pytest.raises(RuntimeError, match="has a post-accumulate-grad hook"):
        _compiled_autograd()(mse(model, x, y))


# --- backwards traced into a compiled function: no hook runs ----------------------------------


@pytest.fixture
def traced_backward():
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        yield


def _bf16_window():
    model = Net(torch.bfloat16)
    opt = fused_accum.AdamW(model.parameters(), lr=LR, master_weights=True)
    return model, opt, data(ACCUM, dtype=torch.bfloat16)


def test_a_compiled_window_of_traced_backwards_is_refused_at_step(traced_backward):
    """Before: the window counted 0 micro-batches and stepped autograd's bf16 running sums as
    if the user had assigned them (1.9e-2 to 3.1e-2 from eager)."""
    model, opt, batches = _bf16_window()

    @torch.compile(backend="aot_eager")
    def window(batches):
        for x, y in batches:
            mse(model, x, y).float().backward()

    window(batches)
    assert opt.microbatches == 0 and all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    with pytest.raises(RuntimeError, match="trace_autograd_ops.*compiled_autograd = True"):
        opt.step()


def test_compiled_micro_steps_of_traced_backwards_are_refused_at_step(traced_backward):
    model, opt, batches = _bf16_window()
    micro = torch.compile(lambda x, y: mse(model, x, y).float().backward(), backend="aot_eager")
    for x, y in batches:
        micro(x, y)
    with pytest.raises(RuntimeError, match="no backward of this window brought"):
        opt.step()


def test_a_traced_backward_before_an_eager_one_is_refused_there(traced_backward):
    model, opt, batches = _bf16_window()
    micro = torch.compile(lambda x, y: mse(model, x, y).float().backward(), backend="aot_eager")
    micro(*batches[0])
    micro(*batches[0])  # (two traced backwards: a bf16 running sum in .grad)
    with pytest.raises(RuntimeError, match="no backward of this window brought"):
        mse(model, *batches[1]).float().backward()


def test_fp32_traced_backwards_are_taken_and_step_as_eager(traced_backward):
    """An fp32 parameter's traced sums are the window's fp32 folds, in the same order: taken."""

    def run(compiled):
        model = Net(torch.float32)
        opt = fused_accum.AdamW(model.parameters(), lr=LR)

        def window(batches):
            for x, y in batches:
                mse(model, x, y).backward()

        window = torch.compile(window, backend="aot_eager") if compiled else window
        for w in range(2):
            window(data(ACCUM, seed=w))
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    _assert_equal(run(True), run(False), "parameters")


def test_a_bf16_grad_assigned_without_a_backward_is_taken_when_backward_is_not_traced():
    """The refusal reads trace_autograd_ops: a user's .grad, assigned with no backward, steps."""
    model, opt, _ = _bf16_window()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
