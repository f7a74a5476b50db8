"""The optimizer inside ``torch.compile``: a compiled step, and one graph per window.

- ``torch.compile(opt.step, fullgraph=True)`` traces (fused_accum.compiled): bit for bit with
  the eager step under ``aot_eager``, one compilation over an lr schedule (the books write each
  group's lr into its device tensor while the graph runs).
- The recipe of docs/compile.md ("One graph per window"): k micro-batches' forward and
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

import math
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import fused_accum
from fused_accum import compiled
import cases  # tests/cases.py

K = 3  # micro-batches per window
WINDOWS = 5
CLIPPED, NONFINITE = 1, 3  # the window whose gradient is clipped, and the one skipped
PRECISIONS = {  # parameter dtype, master_weights
    "fp32": (torch.float32, None),
    "bf16-master": (torch.bfloat16, True),
    "bf16-remainder": (torch.bfloat16, "remainder"),
}
# Each algorithm's default case (tests/cases.py), without its lr: the window's own.
HYPER = {c.algorithm: {k: v for k, v in c.kwargs.items() if k != "lr"} for c in cases.cases(cases.COMPILED_WINDOW)}


def fused_algorithms() -> list:
    """Every fused algorithm that runs in one compiled window (tests/cases.py)."""
    return sorted(HYPER)


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


def build(algorithm, precision, device="cpu", **kwargs):
    """A Net and its optimizer (clip and non-finite skip on; on the CPU, the CPU kernels)."""
    dtype, master = PRECISIONS[precision]
    torch.manual_seed(0)
    model = Net().to(device, dtype)
    if master is not None:
        kwargs["master_weights"] = master
    backend = "cpu" if device == "cpu" else "auto"
    kwargs = {**dict(max_grad_norm=1.0, skip_nonfinite=True, backend=backend), **HYPER.get(algorithm, {}), **kwargs}
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
    """The recipe: what docs/compile.md ("One graph per window") compiles whole."""
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


def compiled_against_eager(built, dtype, what: str) -> tuple:
    """Two (model, optimizer) pairs from ``built()``: the recipe compiled whole (aot_eager,
    fullgraph) on one and run eagerly on the other over every window of ``batches`` (a cosine
    lr), the books equal after each; one graph; the eager run stepped every window but the
    non-finite one (and never the unused parameter). Returns model, opt, ref_model, ref_opt."""
    model, opt = built()
    ref_model, ref_opt = built()
    compiled_window = torch.compile(window, backend="aot_eager", fullgraph=True)
    for w, chunk in enumerate(batches(dtype)):
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = lr_of(w)
        window(ref_model, ref_opt, chunk)
        compiled_window(model, opt, chunk)
        assert_same(model, opt, ref_model, ref_opt, f"{what}, {dtype}, window {w}")
    assert graphs() == 1, f"{graphs()} graphs: a window recompiled"
    steps = ref_opt._window.flat_groups[0].steps
    assert sorted(steps.tolist()) == [0] + [WINDOWS - 1] * (len(steps) - 1), "the eager run skipped no window"
    return model, opt, ref_model, ref_opt


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("algorithm", fused_algorithms())
def test_a_window_compiles_into_one_graph_bit_for_bit_with_eager(algorithm, precision):
    dtype = PRECISIONS[precision][0]
    model, opt, ref_model, ref_opt = compiled_against_eager(lambda: build(algorithm, precision), dtype, algorithm)
    assert opt.last_grad_norm is not None and torch.equal(opt.last_grad_norm, ref_opt.last_grad_norm)
    assert all(p.grad is None for p in model.parameters())
    assert opt.microbatches == 0
    with_state = [
        [name for name, p in m.named_parameters() if p in o.state] for m, o in ((model, opt), (ref_model, ref_opt))
    ]
    assert with_state[0] == with_state[1]


class Matrices(nn.Module):
    """Net's shape without its vectors (LayerNorm, biases), which Muon refuses: Linear -> GELU ->
    Linear without biases, and an unused matrix."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 24, bias=False), nn.Linear(24, 4, bias=False)
        self.unused = nn.Parameter(torch.ones(3, 5))

    def forward(self, x, y):
        return ((self.down(nn.functional.gelu(self.up(x))).float() - y) ** 2).mean() / K


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_muon_window_compiles_into_one_graph_bit_for_bit_with_eager(precision):
    """Muon's split step in the window's graph: the prologue and epilogue (custom ops) and the
    middle's Newton-Schulz matmuls traced with the backwards, over an lr schedule, a clipped and
    a skipped window: one graph, the eager recipe's weights, masters, momenta and steps."""
    dtype, master = PRECISIONS[precision]

    def built():
        torch.manual_seed(0)
        model = Matrices().to(dtype)
        kwargs = dict(max_grad_norm=1.0, skip_nonfinite=True, backend="cpu")
        if master is not None:
            kwargs["master_weights"] = master
        return model, fused_accum.Muon(model.parameters(), lr=1e-2, **kwargs)

    compiled_against_eager(built, dtype, "muon")


def test_a_window_over_two_param_groups_of_two_dtypes_is_one_graph_bit_for_bit_with_eager(hooks):
    """Three flat groups (a group per lr, its LayerNorm in fp32 beside bf16 weights): each steps
    with its own lr, written by the books, which a schedule of the first changes every window.
    With the Python hooks too (before: their look, run by the books inside the custom op's body,
    below autograd, found no AccumulateGrad node and raised)."""

    def built():
        torch.manual_seed(0)
        model = Net().to(torch.bfloat16)
        model.norm.float()
        groups = [
            dict(params=list(model.up.parameters()) + list(model.norm.parameters())),
            dict(params=list(model.down.parameters()) + [model.unused], lr=3e-3, weight_decay=0.0),
        ]
        return model, fused_accum.AdamW(groups, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, backend="cpu")

    model, opt = built()
    ref_model, ref_opt = built()
    assert len(opt._window.flat_groups) == 3
    compiled_window = torch.compile(window, backend="aot_eager", fullgraph=True)
    for w, chunk in enumerate(batches(torch.bfloat16)[:NONFINITE]):
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = lr_of(w)
        window(ref_model, ref_opt, chunk)
        compiled_window(model, opt, chunk)
    assert graphs() == 1
    assert_same(model, opt, ref_model, ref_opt, "two param groups")
    assert [f.lr.item() for f in opt._window.flat_groups] == [f.lr.item() for f in ref_opt._window.flat_groups]


def test_the_recipe_under_inductor_is_as_close_to_eager_as_compiling_the_model_alone():
    """Under inductor the model's kernels round as inductor's do: the one-graph window is held
    to the distance ``torch.compile(model)`` alone (eager backward and step) keeps from eager,
    and is exact where that is."""
    algorithm, precision = "adamw", "bf16-master"
    data = batches(torch.bfloat16)
    ref_model, ref_opt = build(algorithm, precision)
    model, opt = build(algorithm, precision)
    alone_model, alone_opt = build(algorithm, precision)
    compiled_window = torch.compile(window, backend="inductor", fullgraph=True)
    compiled_model = torch.compile(alone_model, backend="inductor")
    for chunk in data:
        window(ref_model, ref_opt, chunk)
        compiled_window(model, opt, chunk)
        window(compiled_model, alone_opt, chunk)
    assert graphs() == 2  # the window's, and the model's forward (its backward is AOT's)

    def distance(m):
        return max((p.float() - q.float()).abs().max().item() for p, q in zip(m.parameters(), ref_model.parameters()))

    assert distance(model) <= distance(alone_model), (distance(model), distance(alone_model))


def plain_window(model, opt, chunk):
    """The plain loop: ``loss.backward()``, which Dynamo traces under trace_autograd_ops."""
    for x, y in chunk:
        model(x, y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_the_plain_loop_compiled_whole_is_refused_in_its_first_window(precision):
    """A traced loss.backward() writes autograd's own sums into .grad and runs no hook: the
    window holds nothing. Refused as the step is traced, naming opt.backward, before anything
    runs. Before: the first window stepped nothing, silently (the next call refused)."""
    model, opt = build("adamw", precision)
    weights = [p.detach().clone() for p in model.parameters()]
    compiled_window = torch.compile(plain_window, backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.UserError, match=r"did not fold.*call opt\.backward\(loss\) instead"):
        compiled_window(model, opt, batches(PRECISIONS[precision][0], 1)[0])
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert opt.microbatches == 0 and all(p.grad is None for p in model.parameters())


def test_the_plain_loop_compiled_without_fullgraph_is_refused_in_its_first_window():
    """Without fullgraph=True Dynamo gives the frame up at the refusal and runs it eagerly,
    compiling its inner frames on their own: the step's books then refuse the assigned .grad,
    before anything is written."""
    model, opt = build("adamw", "bf16-master")
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"call opt\.backward\(loss\)"):
        torch.compile(plain_window, backend="aot_eager")(model, opt, batches(torch.bfloat16, 1)[0])
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert opt.microbatches == 0


# --- the compiled step (eager backwards) -----------------------------------------------------


def test_a_compiled_step_follows_a_cosine_schedule_with_one_compilation():
    """torch's CosineAnnealingLR over 50 windows: one compilation, bit for bit with the eager
    step, and no warning from the scheduler. Before: torch.compile(opt.step, fullgraph=True)
    raised (step was compiler-disabled); and the scheduler's wrapper of opt.step, code Dynamo
    skips, would break the graph (the step now records the call itself)."""
    windows = 50
    model, opt = build("adamw", "bf16-master")
    ref_model, ref_opt = build("adamw", "bf16-master")
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=windows) for o in (ref_opt, opt)]
    step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    items = torch.tensor(float(K))  # (num_items as a tensor: an input of the graph, not a constant)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (the scheduler's, were the step not recorded)
        for chunk in batches(torch.bfloat16, windows):
            for (m, o), stepper, scheduler in zip(
                ((ref_model, ref_opt), (model, opt)), (ref_opt.step, step), schedulers
            ):
                for x, y in chunk:
                    m(x, y).backward()
                stepper(num_items=items)
                o.zero_grad()
                scheduler.step()
            lrs.append(opt._window.flat_groups[0].lr.item())
    assert graphs() == 1
    assert_same(model, opt, ref_model, ref_opt, "50 windows of a cosine schedule")
    assert len(set(lrs)) == windows and lrs[0] == 1e-2  # (each window stepped with its own lr)


def test_a_compiled_step_and_zero_grad_after_eager_backwards_of_bf16_parameters_equal_eager():
    """After eager backwards a bf16 parameter's .grad is its fp32 view, which Dynamo refuses as
    a graph input: neither the step nor zero_grad may read the parameters. Before: zero_grad's
    check for the parameters' own hooks did ("dtype mismatch between tensor and its gradient")."""
    model, opt = build("adamw", "bf16-master")
    ref_model, ref_opt = build("adamw", "bf16-master")

    def step_and_zero(opt):
        opt.step()
        opt.zero_grad()

    compiled_step = torch.compile(step_and_zero, backend="aot_eager", fullgraph=True)
    for w, chunk in enumerate(batches(torch.bfloat16, NONFINITE)):
        for (m, o), stepper in (((ref_model, ref_opt), step_and_zero), ((model, opt), compiled_step)):
            o.param_groups[0]["lr"] = lr_of(w)
            for x, y in chunk:
                m(x, y).backward()
            stepper(o)
    assert graphs() == 1
    assert_same(model, opt, ref_model, ref_opt, "a compiled step and zero_grad")
    assert all(p.grad is None for p in model.parameters())


def _train_with_edit(model, opt, step, edit):
    """Two windows of eager backwards, ``edit(model)`` before each ``step()``."""
    for chunk in batches(torch.bfloat16, 2):
        for x, y in chunk:
            model(x, y).backward()
        edit(model)
        step()
        opt.zero_grad()


def test_a_grad_edited_in_place_before_a_compiled_step_is_taken_as_eagerly():
    def clip(model):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # (in place, in the window's buffers)

    model, opt = build("adamw", "bf16-master", max_grad_norm=None)
    ref_model, ref_opt = build("adamw", "bf16-master", max_grad_norm=None)
    _train_with_edit(model, opt, torch.compile(opt.step, backend="aot_eager", fullgraph=True), clip)
    _train_with_edit(ref_model, ref_opt, ref_opt.step, clip)
    assert_same(model, opt, ref_model, ref_opt, "clip_grad_norm_ before the step")


def _assign(model):
    model.up.weight.grad = torch.full_like(model.up.weight, 0.5)


def _clear(model):
    model.down.bias.grad = None


@pytest.mark.parametrize(
    "edit, message",
    [(_assign, "was assigned"), (_clear, "unlike when the compiled graph was traced")],
    ids=["assigned", "cleared"],
)
def test_a_grad_replaced_before_a_compiled_step_is_refused(edit, message, hooks):
    """The graph steps the slots the window recorded, from its buffers: a .grad assigned (values
    the graph cannot read) or cleared (a slot it would step) since the backward is refused,
    before anything is written, and the window is discarded."""
    model, opt = build("adamw", "bf16-master")
    step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    for x, y in batches(torch.bfloat16, 1)[0]:
        model(x, y).backward()
    edit(model)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=message):
        step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    # (the window discarded: nothing claims gradients, whatever of the graph ran)
    assert opt.microbatches == 0 and all(p.grad is None for p in model.parameters())


def test_a_compiled_window_refuses_an_opt_state_it_cannot_take_and_claims_no_gradient():
    """Refused in the step's books, after the backwards' books recorded the window: the window
    is discarded (inductor may run every call of the books ahead of the folds)."""
    model, opt = build("adamw", "fp32")
    compiled_window = torch.compile(window, backend="aot_eager", fullgraph=True)
    compiled_window(model, opt, batches(torch.float32, 1)[0])
    opt.state[model.up.weight] = {"step": torch.tensor(3.0)}
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"opt.state of parameter .* compiled step cannot take"):
        compiled_window(model, opt, batches(torch.float32, 1)[0])
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert opt.microbatches == 0 and not any(slot.has_grad for slot in opt._window.slots)


def test_the_books_refuse_a_graph_traced_for_other_gradients():
    """The books' check can fail: told a gradient the window does not hold, the step refuses."""
    model, opt = build("adamw", "fp32")
    for x, y in batches(torch.float32, 1)[0]:
        model(x, y).backward()
    with pytest.raises(RuntimeError, match="unlike when the compiled graph was traced"):
        compiled.step_books(opt, [compiled.HELD], [])  # (the unused parameter holds none)


# --- what stays eager -------------------------------------------------------------------------


def _generic(model):
    return fused_accum.FusedAccumOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)


@pytest.mark.parametrize(
    "make, call, reason",
    [
        (_generic, lambda m, o: o.step(), compiled.GENERIC),
        (lambda m: build("adamw", "fp32")[1], lambda m, o: o.step(lambda: None), compiled.CLOSURE),
        (lambda m: build("adamw", "fp32")[1], lambda m, o: o.zero_grad(set_to_none=False), compiled.ZERO_IN_PLACE),
        (
            lambda m: fused_accum.AdamW(m.parameters(), accum_steps=K, step_in_backward=True),
            lambda m, o: o.step(),
            compiled.STEP_IN_BACKWARD,
        ),
    ],
    ids=["torch.optim class", "closure", "zero_grad in place", "step_in_backward"],
)
def test_what_cannot_trace_runs_eagerly_and_fullgraph_names_why(make, call, reason):
    model = Net()
    opt = make(model)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=reason.replace("(", r"\(").replace(")", r"\)")):
        torch.compile(call, backend="aot_eager", fullgraph=True)(model, opt)


# --- on a GPU: one CUDA graph per window --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_the_recipe_under_reduce_overhead_replays_one_cuda_graph_per_window(precision, monkeypatch):
    """mode="reduce-overhead": the books (the window_event op, tagged cudagraph-unsafe) run
    ahead of one captured partition, which replays once per window (torch.cuda.CUDAGraph.replay
    counted) and changes no bit against the same recipe compiled without CUDA graphs; and the
    window is as close to eager as torch.compile(model) alone."""
    replays = []
    real_replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: (replays.append(1), real_replay(self))[1])
    dtype = PRECISIONS[precision][0]
    data = [[(x.cuda(), y.cuda()) for x, y in chunk] for chunk in batches(dtype, 8)]
    data[NONFINITE] = data[0]  # (every window finite: the skip is the CPU tests')

    (graphed, graphed_opt), (plain, plain_opt), (ref, ref_opt), (alone, alone_opt) = (
        build("adamw", precision, "cuda") for _ in range(4)
    )
    graphed_window = torch.compile(window, mode="reduce-overhead", fullgraph=True)
    plain_window = torch.compile(window, mode="max-autotune-no-cudagraphs", fullgraph=True)
    alone_model = torch.compile(alone)
    per_window = []
    for w, chunk in enumerate(data):
        for o in (graphed_opt, plain_opt, ref_opt, alone_opt):
            o.param_groups[0]["lr"] = lr_of(w)
        before = len(replays)
        graphed_window(graphed, graphed_opt, chunk)
        per_window.append(len(replays) - before)
        plain_window(plain, plain_opt, chunk)
        window(ref, ref_opt, chunk)
        window(alone_model, alone_opt, chunk)
    torch.cuda.synchronize()
    # (cudagraph trees: the first call warms up, the second records; every later one replays)
    assert per_window[2:] == [1] * (len(data) - 2), per_window
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert_same(graphed, graphed_opt, plain, plain_opt, f"reduce-overhead against no CUDA graphs, {precision}")

    def distance(m):
        return max((p.float() - q.float()).abs().max().item() for p, q in zip(m.parameters(), ref.parameters()))

    assert distance(graphed) <= distance(alone), (distance(graphed), distance(alone))
