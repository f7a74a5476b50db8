"""The optimizer inside ``torch.compile``: a compiled step, and one graph per window.

- ``torch.compile(opt.step, fullgraph=True)`` traces (fused_accum.compiled): bit for bit with
  the eager step under ``aot_eager``, one compilation over an lr schedule (the books write each
  group's lr into its device tensor while the graph runs).
- The recipe of the README's "torch.compile" section: k micro-batches' forward and
  ``opt.backward(loss)``, ``opt.step()`` and ``opt.zero_grad()`` in one function compiled with
  ``fullgraph=True`` under ``trace_autograd_ops``: one graph, no recompile over later windows (a
  changing lr, a clipped window, a skipped non-finite one), bit for bit with the same recipe run
  eagerly (``opt.backward`` is then ``loss.backward()``) for every fused algorithm, fp32, bf16 +
  fp32 masters and the remainder mode: weights, masters, moments and step counts.
- What the user did to ``.grad`` between compiled calls is taken as eagerly; what a graph cannot
  take (``opt.state`` replaced) is refused, and what stays eager breaks the graph naming why.

Tiny models and few windows: each case compiles once (``aot_eager``, and inductor once).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import fused_accum
from fused_accum import compiled
from fused_accum.algorithms import ALGORITHMS

K = 3  # micro-batches per window
WINDOWS = 5
CLIPPED, NONFINITE = 1, 3  # the window whose gradient is clipped, and the one skipped
PRECISIONS = {  # parameter dtype, master_weights
    "fp32": (torch.float32, None),
    "bf16-master": (torch.bfloat16, True),
    "bf16-remainder": (torch.bfloat16, "remainder"),
}
# Hyper-parameters that make each algorithm use all of its state; an algorithm not named here
# steps with its defaults.
HYPER = {"sgd": dict(momentum=0.9, nesterov=True, weight_decay=0.01), "adamw": dict(weight_decay=0.1)}


def fused_algorithms() -> list:
    """Every fused algorithm (the one place the table is read; tests/cases.py's rows once there)."""
    return sorted(ALGORITHMS)


@pytest.fixture(autouse=True)
def fresh_dynamo(one_thread):
    torch._dynamo.reset()  # (no graph or guard of another test's optimizer reused)
    counters.clear()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        yield
    torch._dynamo.reset()


def graphs() -> int:
    """Graphs Dynamo compiled since the test began (a restart of one trace is not another)."""
    assert not counters["graph_break"], dict(counters["graph_break"])
    return counters["stats"]["unique_graphs"]


class Net(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear (with an unused parameter: it never gets a gradient)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up, self.down = nn.Linear(8, 24), nn.Linear(24, 4)
        self.unused = nn.Parameter(torch.ones(5))

    def forward(self, x, y):
        return ((self.down(nn.functional.gelu(self.up(self.norm(x)))).float() - y) ** 2).mean() / K


def build(algorithm, precision, **kwargs):
    """A Net and its optimizer (clip and non-finite skip on, the CPU kernels)."""
    dtype, master = PRECISIONS[precision]
    torch.manual_seed(0)
    model = Net().to(dtype)
    if master is not None:
        kwargs["master_weights"] = master
    kwargs = dict(max_grad_norm=1.0, skip_nonfinite=True, backend="cpu", **HYPER.get(algorithm, {}), **kwargs)
    return model, fused_accum.FusedAccumOptimizer(model.parameters(), algorithm, lr=1e-2, **kwargs)


def batches(dtype, windows=WINDOWS):
    """Each window's K micro-batches; the CLIPPED window's inputs large (its norm is clipped),
    one of the NONFINITE window's holding an inf (its step is skipped)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for w in range(windows):
        chunk = []
        for j in range(K):
            x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
            if w == CLIPPED:
                y = y * 100
            if w == NONFINITE and j == 1:
                x[2, 3] = float("inf")
            chunk.append((x.to(dtype), y))
        out.append(chunk)
    return out


def window(model, opt, chunk):
    """The recipe: what the README's "torch.compile" section compiles whole."""
    for x, y in chunk:
        opt.backward(model(x, y))
    opt.step()
    opt.zero_grad()


def lr_of(w: int) -> float:
    return 1e-2 * (0.5 + 0.5 * math.cos(math.pi * w / 50))  # a cosine schedule


def books(opt) -> dict:
    """What must match bit for bit: weights, masters (the remainders too), moments, step counts."""
    out = {}
    for i, flat in enumerate(opt._window.flat_groups):
        out[f"flat {i} steps"] = flat.steps
        if flat.master is not None:
            out[f"flat {i} masters"] = flat.master
        for key, buf in flat.state.items():
            out[f"flat {i} {key}"] = buf
    return out


def assert_same(model, opt, ref_model, ref_opt, what):
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), f"{what}: weight {name} differs by {(p.float() - q.float()).abs().max():.3g}"
    ours, theirs = books(opt), books(ref_opt)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), f"{what}: {key} differs"


# --- one graph per window ---------------------------------------------------------------------


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("algorithm", fused_algorithms())
def test_a_window_compiles_into_one_graph_bit_for_bit_with_eager(algorithm, precision):
    dtype = PRECISIONS[precision][0]
    model, opt = build(algorithm, precision)
    ref_model, ref_opt = build(algorithm, precision)
    compiled_window = torch.compile(window, backend="aot_eager", fullgraph=True)
    for w, chunk in enumerate(batches(dtype)):
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = lr_of(w)
        window(ref_model, ref_opt, chunk)
        compiled_window(model, opt, chunk)
        assert_same(model, opt, ref_model, ref_opt, f"{algorithm}, {precision}, window {w}")
    assert graphs() == 1, f"{graphs()} graphs: a window recompiled"
    steps = ref_opt._window.flat_groups[0].steps
    # (the unused parameter never steps; the others skipped the non-finite window)
    assert sorted(steps.tolist()) == [0] + [WINDOWS - 1] * (len(steps) - 1), "the eager run skipped no window"
    assert opt.last_grad_norm is not None and torch.equal(opt.last_grad_norm, ref_opt.last_grad_norm)
    assert all(p.grad is None for p in model.parameters())
    assert opt.microbatches == 0
    with_state = [
        [name for name, p in m.named_parameters() if p in o.state] for m, o in ((model, opt), (ref_model, ref_opt))
    ]
    assert with_state[0] == with_state[1]
