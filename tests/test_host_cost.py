"""Host cost is part of the contract (DESIGN.md, "Host cost is part of the contract").

A steady-state ``step()`` and a window's backwards never sync with the device, and the number of
aten ops they issue does not grow with the number of parameters: it follows flat groups and
buckets. A sync is invisible on a CPU and fatal on a GPU (it serialises the stream and raises
under CUDA-graph capture), and a per-parameter op is a kernel launch per parameter there, so
both are counted here, on the CPU, where CI runs: by the torch profiler, which records every
aten op that reaches the dispatcher (nested ones, and those the C++ kernels and hooks call,
included).

Each case trains the same optimizer over 64 and over 2,048 small parameters and compares the
counts. The backwards are ``torch.autograd.backward(params, grads)``: the parameters' own
AccumulateGrad nodes are the roots, so every op in them is the optimizer's hooks' (a model's
backward would add per-parameter ops of its own). One bucket in both (``bucket_cap_mb`` large),
so bucket counts do not differ either.

The bound is 1.5x (the issue's; the counts measured are equal at 64 and 2,048 parameters for
every case here): a per-parameter op at 2,048 parameters is 32x.
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch

import fused_accum
from fused_accum.backends import ext

pytestmark = pytest.mark.skipif(
    ext._C is None or not hasattr(ext._C, "Arrivals"), reason="the host-cost promises are the extension's"
)

# What makes the host wait for the device: reading a value (item, bool(t), float(t)), an output
# sized by the data (nonzero), a comparison returned as a Python bool (equal, allclose).
SYNC_OPS = {
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::equal",
    "aten::allclose",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique2",
}
SMALL, LARGE = 64, 2048
NUMEL = 256
GROWTH = 1.5


def aten_ops(fn) -> collections.Counter:
    """Every aten op ``fn`` issues, by name, nested ones included."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def syncs(ops: collections.Counter) -> dict:
    return {name: n for name, n in ops.items() if name in SYNC_OPS}


ALGORITHMS = {
    "sgd": lambda params, **kw: fused_accum.SGD(params, lr=0.1, momentum=0.9, **kw),
    "sgd-nesterov-wd": lambda params, **kw: fused_accum.SGD(
        params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, **kw
    ),
    "adam": lambda params, **kw: fused_accum.Adam(params, lr=1e-3, **kw),
    "adamw": lambda params, **kw: fused_accum.AdamW(params, lr=1e-3, weight_decay=0.1, **kw),
    "adamw-amsgrad": lambda params, **kw: fused_accum.AdamW(params, lr=1e-3, amsgrad=True, **kw),
    "lion": lambda params, **kw: fused_accum.Lion(params, lr=1e-4, **kw),
}
# parameter dtype, master_weights
PRECISIONS = {
    "bf16-master": (torch.bfloat16, True),
    "bf16-nomaster": (torch.bfloat16, False),
    "fp32": (torch.float32, None),
}


class Run:
    """``n`` parameters of NUMEL elements, their optimizer, and one window's gradients."""

    def __init__(self, n, algorithm, precision, accum_steps=2, scaler=False, **kwargs):
        dtype, master = PRECISIONS[precision]
        gen = torch.Generator().manual_seed(n)
        self.params = [torch.nn.Parameter(torch.randn(NUMEL, generator=gen).to(dtype)) for _ in range(n)]
        self.grads = [torch.randn(NUMEL, generator=gen).to(dtype) * 1e-2 for _ in range(n)]
        if master is not None:
            kwargs["master_weights"] = master
        self.opt = ALGORITHMS[algorithm](
            self.params, accum_steps=accum_steps, backend="cpu", bucket_cap_mb=64, **kwargs
        )
        self.accum_steps = accum_steps
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaler else None

    def backward(self):
        grads = self.grads
        if self.scaler is not None:
            grads = self.scaler.scale(grads)  # (scaled as a scaled loss's backward would be)
        torch.autograd.backward(self.params, grads)

    def step(self, **kwargs):
        if self.scaler is not None:
            self.scaler.step(self.opt, **kwargs)
            self.scaler.update()
        else:
            self.opt.step(**kwargs)

    def window(self, **step_kwargs):
        for _ in range(self.accum_steps):
            self.backward()
        self.step(**step_kwargs)
        self.opt.zero_grad()


def _step_ops(n, algorithm, precision, step_kwargs=None, **kwargs) -> collections.Counter:
    step_kwargs = step_kwargs or {}
    run = Run(n, algorithm, precision, **kwargs)
    for _ in range(3):  # past the first steps, which allocate state and show opt.state
        run.window(**step_kwargs)
    for _ in range(run.accum_steps):
        run.backward()
    return aten_ops(lambda: run.step(**step_kwargs))


STEP_CASES = [pytest.param(a, p, {}, {}, id=f"{a}-{p}") for a in ALGORITHMS for p in PRECISIONS] + [
    pytest.param("adamw", "bf16-master", {"max_grad_norm": 1.0}, {}, id="adamw-clip"),
    pytest.param("sgd", "fp32", {"max_grad_norm": 1.0}, {}, id="sgd-clip"),
    pytest.param("lion", "bf16-master", {"max_grad_norm": 1.0, "skip_nonfinite": True}, {}, id="lion-clip-skip"),
    pytest.param("adamw", "bf16-master", {"skip_nonfinite": True}, {}, id="adamw-skip"),
    pytest.param("adamw", "bf16-master", {}, {"num_items": torch.tensor(123.0)}, id="adamw-num_items-tensor"),
    pytest.param("adam", "fp32", {}, {"num_items": 77}, id="adam-num_items-int"),
    pytest.param(
        "adamw", "bf16-master", {"max_grad_norm": 1.0}, {"num_items": torch.tensor(9.0)}, id="adamw-clip-items"
    ),
    pytest.param("adamw", "fp32", {"scaler": True}, {}, id="adamw-gradscaler"),
    pytest.param("sgd", "fp32", {"scaler": True, "max_grad_norm": 1.0}, {}, id="sgd-gradscaler-clip"),
]


@pytest.mark.parametrize("algorithm, precision, kwargs, step_kwargs", STEP_CASES)
def test_a_steady_state_step_never_syncs_and_its_op_count_does_not_grow_with_the_parameters(
    algorithm, precision, kwargs, step_kwargs, one_thread
):
    small = _step_ops(SMALL, algorithm, precision, step_kwargs, **kwargs)
    large = _step_ops(LARGE, algorithm, precision, step_kwargs, **kwargs)
    assert syncs(small) == {} and syncs(large) == {}, (syncs(small), syncs(large))
    n_small, n_large = sum(small.values()), sum(large.values())
    grown = {k: (small[k], large[k]) for k in large if large[k] > small[k]}
    assert n_large <= GROWTH * n_small, f"{n_small} ops at {SMALL} params, {n_large} at {LARGE}; grown: {grown}"


def test_the_step_op_count_test_sees_a_per_parameter_sync(monkeypatch, one_thread):
    """The test above can fail: a step that reads one value per parameter (the regression the
    test was written for: each parameter's state reloaded through ``item()``) is caught."""
    from fused_accum import step as step_module

    real = step_module.Stepper.take_user_state

    def reloads_everything(self, flat, active, group):
        for slot in active:
            float(flat.steps[slot.index].item())
        return real(self, flat, active, group)

    monkeypatch.setattr(step_module.Stepper, "take_user_state", reloads_everything)
    small = _step_ops(SMALL, "adamw", "bf16-master")
    large = _step_ops(LARGE, "adamw", "bf16-master")
    assert syncs(large).get("aten::item") == LARGE
    assert sum(large.values()) > GROWTH * sum(small.values())


# --- backwards ---------------------------------------------------------------------------------


def _python_calls_into_package(fn) -> list:
    """The fused_accum functions Python entered while ``fn`` ran (its own frame excluded)."""
    package = fused_accum.__file__.rsplit("/", 1)[0] + "/"
    entered = []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            entered.append(f"{frame.f_code.co_filename[len(package) :]}:{frame.f_code.co_name}")

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered


BACKWARD_CASES = [
    pytest.param("adamw", "bf16-master", {}, id="adamw-bf16"),
    pytest.param("sgd", "fp32", {}, id="sgd-fp32"),
    pytest.param("lion", "bf16-nomaster", {}, id="lion-bf16-nomaster"),
    pytest.param("adamw", "bf16-master", {"max_grad_norm": 1.0, "skip_nonfinite": True}, id="adamw-clip-skip"),
]


def _window_ops(n, algorithm, precision, accum_steps, **kwargs) -> list:
    """The aten ops of each backward of a steady-state window, and the fused_accum Python
    functions each entered."""
    run = Run(n, algorithm, precision, accum_steps=accum_steps, **kwargs)
    for _ in range(3):
        run.window()
    per_backward = []
    for _ in range(accum_steps):
        calls = []
        ops = aten_ops(lambda: calls.extend(_python_calls_into_package(run.backward)))
        per_backward.append((ops, calls))
    run.step()
    run.opt.zero_grad()
    return per_backward


@pytest.mark.parametrize("algorithm, precision, kwargs", BACKWARD_CASES)
def test_a_windows_backwards_never_sync_the_middle_ones_call_no_python_and_none_grows_with_the_parameters(
    algorithm, precision, kwargs, monkeypatch, one_thread
):
    monkeypatch.delenv("FUSED_ACCUM_PYTHON_HOOKS", raising=False)
    k = 4
    small = _window_ops(SMALL, algorithm, precision, k, **kwargs)
    large = _window_ops(LARGE, algorithm, precision, k, **kwargs)
    for i, ((ops_s, _), (ops_l, calls_l)) in enumerate(zip(small, large)):
        which = "first" if i == 0 else "last" if i == k - 1 else "middle"
        assert syncs(ops_s) == {} and syncs(ops_l) == {}, (which, syncs(ops_s), syncs(ops_l))
        n_s, n_l = sum(ops_s.values()), sum(ops_l.values())
        assert n_l <= GROWTH * max(n_s, 1), f"{which} backward: {n_s} ops at {SMALL} params, {n_l} at {LARGE}"
        if which == "middle":
            assert calls_l == [], f"a middle backward called Python: {calls_l[:10]}"
        else:
            # The first and last call Python once per backward and per bucket, not per parameter.
            assert len(calls_l) < LARGE // 8, f"{which} backward: {len(calls_l)} Python calls"
