"""The per-parameter hooks (fused_accum/arrivals.py): the C++ ones of fused_accum._C and their
Python twin keep one contract, checked here against torch's own ``.grad`` accumulation.

Every test runs on both implementations (``hooks`` fixture). The rest of the suite runs on the
C++ hooks where the extension is built; scripts/test_all.sh runs the drop-in tests on the Python
ones too.
"""

import gc
import threading
import warnings

import pytest
import torch
import typing_extensions
from torch import nn

import fused_accum
from fused_accum import arrivals
from fused_accum.extension import _C
from helpers import RaiseWhenArmed  # tests/helpers.py

HAVE_CPP = _C is not None and hasattr(_C, "Arrivals")


@pytest.fixture
def cpp_hooks(monkeypatch):
    """The C++ hooks only: what the Python twin does not have (quiet backwards)."""
    if not HAVE_CPP:
        pytest.skip("fused_accum._C is not built")
    monkeypatch.delenv("FUSED_ACCUM_PYTHON_HOOKS", raising=False)


def _kind(opt) -> str:
    return "python" if isinstance(opt._window._arrivals, arrivals.PythonArrivals) else "cpp"


def _pair(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5)).to(dtype)
    b = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5)).to(dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 7, generator=g) for _ in range(n)]


def _members(protocol) -> set:
    """A protocol's members: its methods and its annotated attributes (the table's flags)."""
    return set(typing_extensions.get_protocol_members(protocol))


def _public(table) -> set:
    return {name for name in dir(table) if not name.startswith("_")}


def _table(kind: str):
    noop = lambda *args: None  # noqa: E731
    cls = _C.Arrivals if kind == "cpp" else arrivals.PythonArrivals
    return cls(noop, noop, noop, noop, noop)


def test_the_window_and_the_table_exchange_one_plan_and_one_report():
    # The contract: the table's flags and fast path are one value handed in (Plan), what the
    # hooks did one value taken back (Report); no per-flag or per-grant member is left.
    members = _members(arrivals.HookTable)
    assert {"fast", "hand", "plan", "report", "look", "extend", "attach"} <= members
    gone = {"slow", "hide", "stands_aside", "take_partial", "grant_fast", "revoke_fast", "take_overwritten"}
    gone |= {"rehook", "expose", "changed"}  # (one look at the start, .grad's views with the plan)
    assert not members & (gone | {"arm_quiet", "quiet_backwards", "python_seen"})
    assert arrivals.Plan._fields == ("stands_aside", "slow", "hide", "seen", "grants", "quiet_until", "counters", "at")
    assert arrivals.Report._fields == ("overwritten", "partial", "quiet")
    assert arrivals.Grant._fields == ("bucket", "acc", "offsets", "overwrite")
    assert arrivals.Look._fields == ("moved", "changed")


def test_each_implementation_has_exactly_the_members_of_its_protocol(hooks):
    # One contract: both tables are HookTables, the C++ one acting on the whole plan (fast),
    # the Python twin on its flags only, and neither has a public member the protocol lacks.
    table = _table(hooks)
    protocol = arrivals.HookTable
    assert sorted(_members(protocol) - _public(table)) == [], "members of the protocol the table lacks"
    assert sorted(_public(table) - _members(protocol)) == [], "members of the table the protocol lacks"
    assert isinstance(table, arrivals.HookTable)
    assert table.fast == (hooks == "cpp")


def _flag_plans():
    return [
        arrivals.Plan(),
        arrivals.Plan(stands_aside=True, slow=False, hide=True, seen=7),
        arrivals.Plan(slow=True, hide=True, seen=3),
    ]


def test_a_plan_handed_is_the_plan_in_force_and_prints(hooks):
    table = _table(hooks)
    assert table.plan == arrivals.Plan()  # a new table: slow, nothing hidden or granted
    for plan in _flag_plans():
        table.hand(plan)
        assert table.plan == plan
        assert repr(table.plan) == repr(plan) and repr(plan).startswith("Plan(stands_aside=")


def test_a_plan_with_grants_and_quiet_backwards_round_trips_and_prints(cpp_hooks):
    import array

    table = _table("cpp")
    table.extend([2, 1], [0, 0, 1], [0, 1, 0], ["a", "b", "c"])
    acc, offsets = torch.zeros(12), torch.tensor([0, 4])
    counters = array.array("q", [5, 2])
    grants = (arrivals.Grant(0, acc, offsets, True), arrivals.Grant(1, acc, torch.tensor([8]), False))
    plan = arrivals.Plan(slow=True, hide=True, seen=4, grants=grants, quiet_until=9, counters=counters, at=5)
    table.hand(plan)
    assert table.plan == plan
    text = repr(table.plan)
    assert "Grant(0, <float32[12] cpu>, offsets=[0, 4], overwrite=True)" in text and "quiet_until=9" in text
    table.hand(plan._replace(grants=grants[1:], quiet_until=0))  # a grant left out is revoked
    assert table.plan == plan._replace(grants=grants[1:], quiet_until=0)
    table.clear()  # the grants and quiet backwards go; the flags stay
    assert table.plan == plan._replace(grants=(), quiet_until=0)
    with pytest.raises(RuntimeError, match="no bucket"):
        table.hand(arrivals.Plan(grants=(arrivals.Grant(2, acc, offsets, False),)))


def test_the_python_twin_takes_no_fast_path():
    table = _table("python")
    acc = torch.zeros(4)
    with pytest.raises(ValueError, match="no fast path"):
        table.hand(arrivals.Plan(grants=(arrivals.Grant(0, acc, torch.tensor([0]), False),)))


def test_a_plan_handed_with_views_shows_them_and_a_look_finds_what_the_user_changed(hooks):
    # hand(plan, show): .grad = the view where held, None where it was a view no longer held;
    # look(params): the .grad changed since (cleared, replaced, re-pointed), and nothing else.
    table = _table(hooks)
    params = [nn.Parameter(torch.randn(3)) for _ in range(4)]
    table.extend([4], [0, 0, 0, 0], [0, 1, 2, 3], ["a", "b", "c", "d"])
    for key, p in enumerate(params):
        table.attach(key, p)
    views = [torch.randn(3) for _ in params]
    table.hand(arrivals.Plan(), (views, [True, True, True, False]))
    assert [p.grad is v for p, v in zip(params, views)] == [True, True, True, False]
    assert params[3].grad is None
    assert table.look(params) == arrivals.Look((), ())
    params[0].grad = None  # cleared
    params[1].grad = torch.zeros(3)  # replaced
    params[2].grad.data = torch.ones(3)  # re-pointed
    assert table.look(params) == arrivals.Look((), (0, 1, 2))
    table.hand(arrivals.Plan(), (views, [False, False, True, False]))  # a view no longer held goes
    assert params[1].grad is not None and params[2].grad is views[2]
    assert table.look(params) == arrivals.Look((), (1,))  # (the user's tensor: not ours to clear)
    table.hand(arrivals.Plan())  # no show: .grad left as it is
    assert params[2].grad is views[2]


def test_a_look_hooks_a_rebuilt_node_again(hooks):
    table = _table(hooks)
    params = [nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))]
    table.extend([2], [0, 0], [0, 1], ["a", "b"])
    for key, p in enumerate(params):
        table.attach(key, p)
    assert table.look(params) == arrivals.Look((), ())
    params[1].data = params[1].data.double()  # a cast: autograd builds a new node
    assert table.look(params) == arrivals.Look((1,), ())
    assert table.look(params) == arrivals.Look((), ())  # hooked on the new one
    table.detach_all()
    params[0].data = params[0].data.double()
    assert table.look(params).moved == ()  # nothing once detached


def test_a_report_holds_what_arrived_and_prints(hooks):
    table = _table(hooks)
    table.extend([2], [0, 0], [0, 1], ["a", "b"])
    assert table.report(True) == arrivals.Report((), (), 0)
    table.arrive_in_place(1)
    assert table.has_arrivals()
    mid = table.report(False)  # (partial buckets only at the end)
    assert mid.partial == () and table.has_arrivals()
    report = table.report(True)
    assert report.overwritten == () and report.quiet == 0
    assert [(b, grads) for b, grads in report.partial] == [(0, [None, None])]
    assert repr(report) == "Report(overwritten=(), partial=[(0, [None, None])], quiet=0)"
    assert not table.has_arrivals()
    grads = arrivals.Report((1,), ((0, [torch.ones(3, dtype=torch.bfloat16), None]),), 4)
    assert repr(grads) == "Report(overwritten=(1,), partial=[(0, [<bfloat16[3] cpu>, None])], quiet=4)"


class _CountingTable:
    """A table whose calls are counted by name (the window's side of the contract)."""

    def __init__(self, table, calls: list):
        self._table, self._calls = table, calls

    def __getattr__(self, name):
        value = getattr(self._table, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            self._calls.append(name)
            return value(*args, **kwargs)

        return call


@pytest.mark.parametrize("clip", [True, False])
def test_the_window_hands_one_plan_and_takes_one_report_per_backward(hooks, monkeypatch, clip):
    # One call each way at each end of a backward the window sees: at its start the window
    # looks (nodes rebuilt, .grad changed: one pass) and hands the plan its checks decided; at
    # its end it takes the report and hands the plan for the next ones, .grad's views with it.
    # The C++ hooks run the middle backwards without a call.
    from fused_accum import window as window_module

    calls: list = []
    make = window_module.make_arrivals
    monkeypatch.setattr(window_module, "make_arrivals", lambda *c: _CountingTable(make(*c), calls))
    a, _ = _pair()
    opt = fused_accum.SGD(
        a.parameters(), lr=0.1, accum_steps=4, max_grad_norm=1.0 if clip else None, bucket_cap_mb=50 * 4 / 2**20
    )
    per_backward, per_step = [], []
    for window in range(2):
        for x in _batches(4, seed=window):
            del calls[:]
            a(x).square().mean().backward()
            per_backward.append(sorted(calls))
        del calls[:]
        opt.step()
        per_step.append(list(calls))
        del calls[:]
        opt.zero_grad()
        per_step.append(list(calls))
    python = sorted(["look", "hand", "report", "hand"])
    quiet = [] if hooks == "cpp" else python
    assert per_backward == [python, quiet, quiet, quiet] * 2
    # step(): the partial buckets' report, one look (.grad edits, moved nodes), one plan with
    # .grad's views; zero_grad(): a look, the table cleared, one plan, every .grad cleared.
    step, zero_grad = ["report", "look", "hand"], ["look", "clear", "hand", "clear_grads"]
    assert per_step == [step, zero_grad] * 2


def test_make_arrivals_gives_the_table_asked_for(hooks):
    noop = lambda *args: None  # noqa: E731
    table = arrivals.make_arrivals(noop, noop, noop, noop, noop)
    assert isinstance(table, _C.Arrivals if hooks == "cpp" else arrivals.PythonArrivals)


def test_the_implementation_chosen_is_the_one_asked_for(hooks):
    a, _ = _pair()
    opt = fused_accum.AdamW(a.parameters(), lr=1e-3)
    assert _kind(opt) == hooks


def test_windows_match_torch_accumulation(hooks):
    # Small buckets (50 floats), so a backward completes several. Plain SGD: ours and torch's
    # round its update alike, so the models stay equal and so do their gradients, bit for bit.
    a, b = _pair()
    ours = fused_accum.SGD(a.parameters(), lr=0.25, bucket_cap_mb=50 * 4 / 2**20)
    assert len(ours._window._folder.bucket_ids) > 1
    ref = torch.optim.SGD(b.parameters(), lr=0.25)
    for window in range(3):
        for x in _batches(3, seed=window):
            a(x).square().mean().backward()
            b(x).square().mean().backward()
            for p, q in zip(a.parameters(), b.parameters()):
                # fp32 sums of the same fp32 gradients in the same order: equal bit for bit
                assert torch.equal(p.grad, q.grad)
        ours.step()
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_a_tensor_hook_registered_after_the_optimizer_still_runs_first(hooks):
    # Native semantics: tensor hooks change the gradient before it is accumulated.
    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.1)
    for p in list(a.parameters()) + list(b.parameters()):
        p.register_hook(lambda g: 3 * g)
    for x in _batches(2):
        a(x).sum().backward()
        b(x).sum().backward()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)  # 3*g1 + 3*g2 either way
    assert opt.microbatches == 2


def test_a_post_accumulate_grad_hook_sees_and_edits_the_running_sum(hooks):
    # Native semantics: the hook runs after each backward's gradient is added into .grad, so it
    # sees the sum so far, and an in-place edit (a clamping hook) applies to that sum. Here on a
    # parameter shared by several buckets' neighbours, against torch's own accumulation.
    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.25, bucket_cap_mb=50 * 4 / 2**20)
    ref = torch.optim.SGD(b.parameters(), lr=0.25)
    seen = {"ours": [], "torch": []}

    def clamp(side):
        def hook(p):
            seen[side].append(p.grad.clone())
            p.grad.clamp_(-0.05, 0.05)

        return hook

    a[0].weight.register_post_accumulate_grad_hook(clamp("ours"))
    b[0].weight.register_post_accumulate_grad_hook(clamp("torch"))
    for window in range(2):
        for x in _batches(3, seed=window):
            a(x).square().mean().backward()
            b(x).square().mean().backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert len(seen["ours"]) == len(seen["torch"]) == 6 and opt.microbatches == 0
    for got, want in zip(seen["ours"], seen["torch"]):
        # fp32 sums of the same fp32 gradients, clamped alike: equal bit for bit
        assert torch.equal(got, want)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def _optimizers(a, b, hook_nodes, hooked: str, **kwargs) -> tuple:
    """fused_accum.SGD over ``a``, torch.optim.SGD over ``b``, the nodes hooked
    (``hook_nodes()``) before or after they are built, as ``hooked`` says."""
    if hooked == "before_the_optimizer":
        hook_nodes()
    ours, ref = fused_accum.SGD(a.parameters(), lr=0.25, **kwargs), torch.optim.SGD(b.parameters(), lr=0.25)
    if hooked == "after_the_optimizer":
        hook_nodes()
    return ours, ref


def _assert_seen_and_trained_alike(seen: dict, count: int, a, b) -> None:
    assert len(seen["ours"]) == len(seen["torch"]) == count
    for got, want in zip(seen["ours"], seen["torch"]):
        # fp32 sums of the same fp32 gradients, in the same order, edited alike: bit for bit
        assert got is not None and torch.equal(got, want)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)  # (plain SGD: ours and torch's round its update alike)


def _windows_side_by_side(a, b, ours, ref, windows=2, k=3, forward=None, same_grads=False):
    """Both models through the same windows of ``k`` backwards of ``forward(model, x)``'s
    output squared (default: the model's mean), each optimizer stepping and zeroing after each
    window; with ``same_grads``, ``.grad`` is checked against torch's after each backward."""
    for window in range(windows):
        for x in _batches(k, seed=window):
            for model in (a, b):
                (forward(model, x).square().sum() if forward else model(x).square().mean()).backward()
            for p, q in zip(a.parameters(), b.parameters()):
                assert not same_grads or torch.equal(p.grad, q.grad)  # the same fp32 adds, in order
        for opt in (ours, ref):
            opt.step()
            opt.zero_grad()


def _accumulate_grad_node(p, keep: list):
    """A parameter's AccumulateGrad node, as Megatron and DeepSpeed reach it to hook it, kept
    alive as they keep it (a tensor holds its node weakly: one nobody holds is rebuilt, without
    the hooks, by the next forward)."""
    keep.append(p.expand_as(p).grad_fn.next_functions[0][0])
    return keep[-1]


@pytest.mark.parametrize("hooked", ["before_the_optimizer", "after_the_optimizer"])
@pytest.mark.parametrize("step_in_backward", [False, True])
def test_a_post_hook_on_the_accumulate_grad_node_sees_and_edits_the_running_sum(hooks, step_in_backward, hooked):
    # The overlapped all-reduce idiom of Megatron and DeepSpeed (their wrappers hook the nodes
    # before the optimizer is built): a hook on the parameter's AccumulateGrad node runs after
    # the gradient was added into .grad, so it reads the sum so far (the window's first
    # backward included) and may edit it (a clamp here), as natively.
    a, b = _pair()
    seen = {"ours": [], "torch": []}

    def clamp(side, p):
        def hook(grad_inputs, grad_outputs):
            seen[side].append(None if p.grad is None else p.grad.clone())
            p.grad.clamp_(-0.05, 0.05)

        return hook

    def hook_nodes():
        for side, model in (("ours", a), ("torch", b)):
            _accumulate_grad_node(model[0].weight, nodes).register_hook(clamp(side, model[0].weight))

    nodes = []
    ours, ref = _optimizers(a, b, hook_nodes, hooked, accum_steps=3, step_in_backward=step_in_backward)
    _windows_side_by_side(a, b, ours, ref)
    _assert_seen_and_trained_alike(seen, 6, a, b)


@pytest.mark.parametrize("hooked", ["before_the_optimizer", "after_the_optimizer"])
def test_a_pre_hook_on_the_accumulate_grad_node_is_handed_the_gradient(hooks, hooked):
    # A pre-hook on the node (registered after the optimizer, it runs after the window's own)
    # is handed the gradient and may replace it, before it is added to .grad; a post-hook
    # beside it then reads the new sum.
    a, b = _pair()
    seen = {"ours": [], "torch": []}

    def hooks_of(side, p):
        def pre(grad_outputs):
            seen[side].append(grad_outputs[0].clone())
            return (grad_outputs[0] * 3,)

        def post(grad_inputs, grad_outputs):
            seen[side].append(p.grad.clone())

        return pre, post

    def hook_nodes():
        for side, model in (("ours", a), ("torch", b)):
            pre, post = hooks_of(side, model[0].weight)
            node = _accumulate_grad_node(model[0].weight, nodes)
            node.register_prehook(pre)
            node.register_hook(post)

    nodes = []
    ours, ref = _optimizers(a, b, hook_nodes, hooked)
    _windows_side_by_side(a, b, ours, ref)
    _assert_seen_and_trained_alike(seen, 12, a, b)


def test_step_in_backward_steps_with_a_post_accumulate_grad_hooks_edit(hooks):
    # The hook clamps the running sum after every backward, the last one included: the step
    # taken in that backward is the clamped sum's, as torch.optim's step() after it.
    a, b = _pair()
    ours = fused_accum.SGD(a.parameters(), lr=0.25, accum_steps=3, step_in_backward=True)
    ref = torch.optim.SGD(b.parameters(), lr=0.25)

    def clamp(p):
        p.grad.clamp_(-0.05, 0.05)

    for model in (a, b):
        model[0].weight.register_post_accumulate_grad_hook(clamp)
    _windows_side_by_side(a, b, ours, ref)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)  # plain SGD over the same fp32 sums: rounded alike


def test_gradients_that_go_through_accumulate_grad_sum_like_the_rest(hooks):
    # The pre-hook takes most gradients itself; a parameter with a post-accumulate-grad hook (it
    # reads .grad) and any backward with create_graph=True leave them to AccumulateGrad, and the
    # post-hook takes them from .grad. Mixed in one bucket and one window, the sums are torch's,
    # bit for bit (fp32 sums of the same gradients in the same order).
    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.1)
    for model in (a, b):
        model[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    for i, x in enumerate(_batches(4)):
        for model in (a, b):
            model(x).square().sum().backward(create_graph=i == 2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.grad.grad_fn is None  # our running sum, not autograd's differentiable one
        torch.testing.assert_close(p.grad, q.grad.detach(), rtol=0, atol=0)
    assert opt.microbatches == 4


def test_autograd_grad_leaves_the_window_alone(hooks):
    a, _ = _pair()
    opt = fused_accum.AdamW(a.parameters(), lr=1e-3)
    x = _batches(1)[0]
    a(x).sum().backward()
    before = [p.grad.clone() for p in a.parameters()]
    grads = torch.autograd.grad(a(x).sum(), list(a.parameters()))
    for p, g, old in zip(a.parameters(), grads, before):
        assert torch.equal(p.grad, old)
        torch.testing.assert_close(g, old, rtol=0, atol=0)  # the same micro-batch again
    assert opt.microbatches == 1


def test_after_remove_hooks_autograd_accumulates_natively(hooks):
    a, b = _pair()
    opt = fused_accum.AdamW(a.parameters(), lr=1e-3)
    opt.remove_hooks()
    for x in _batches(2):
        a(x).sum().backward()
        b(x).sum().backward()
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="can no longer step"):
        opt.step()


def test_a_deleted_optimizer_leaves_native_accumulation(hooks):
    a, b = _pair()
    opt = fused_accum.AdamW(a.parameters(), lr=1e-3)
    x = _batches(1)[0]
    a(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        del opt
        gc.collect()
    for p in a.parameters():
        p.grad = None
    for x in _batches(2):
        a(x).sum().backward()
        b(x).sum().backward()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_newer_optimizer_takes_the_gradients(hooks):
    a, b = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        old = fused_accum.AdamW(a.parameters(), lr=1e-3)
        new = fused_accum.SGD(a.parameters(), lr=1e-3)
    for x in _batches(2):
        a(x).sum().backward()
        b(x).sum().backward()
    assert new.microbatches == 2
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="can no longer step"):
        old.step()


def test_an_error_raised_in_the_window_reaches_the_caller_of_backward(hooks):
    a, _ = _pair()
    opt = fused_accum.AdamW(a.parameters(), lr=1e-3, accum_steps=1, step_in_backward=True)
    x = _batches(1)[0]
    a(x).sum().backward()  # the window's last backward: stepped in it
    with pytest.raises(RuntimeError, match="step_in_backward already stepped"):
        a(x).sum().backward()
    opt.step()
    opt.zero_grad()
    a(x).sum().backward()  # and the window works again after the error
    assert opt.microbatches == 1


def test_bf16_gradients_are_accumulated_in_fp32(hooks):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(37, dtype=torch.bfloat16))
    opt = fused_accum.AdamW([p], lr=1e-3)
    xs = [torch.randn(37, dtype=torch.bfloat16) for _ in range(4)]
    for x in xs:
        (p * x).sum().backward()
    assert p.grad.dtype == torch.float32
    # d/dp (p*x).sum() = x: the fp32 sum of the bf16 inputs, exactly (each bf16 is exact in fp32,
    # and four 8-bit-mantissa values sum exactly well within fp32's 24 bits)
    assert torch.equal(p.grad, torch.stack([x.float() for x in xs]).sum(0))
    assert opt.microbatches == 4


@pytest.mark.parametrize("clip", [True, False])
def test_middle_micro_batches_fold_in_the_hooks_without_calling_python(hooks, monkeypatch, clip):
    # With accum_steps=4: the first backward overwrites, the middle ones and the last add. With
    # clipping too: the norm is taken from the buffers at step(), not by the last backward's
    # folds, so the C++ hooks fold every backward themselves (the Python twin never does). The
    # gradients are torch's either way, bit for bit.
    a, b = _pair()
    # lr=0: the parameters stay equal to b's, which no optimizer steps
    opt = fused_accum.AdamW(
        a.parameters(), lr=0.0, accum_steps=4, max_grad_norm=1e9 if clip else None, bucket_cap_mb=50 * 4 / 2**20
    )
    n_buckets = len(opt._window._folder.bucket_ids)
    calls = []
    original = type(opt._window._folder).bucket_complete  # (the fold of a bucket the hooks did not fold)
    monkeypatch.setattr(
        type(opt._window._folder), "bucket_complete", lambda self, *args: (calls.append(args[0]), original(self, *args))
    )
    per_backward = []
    for window in range(2):
        for x in _batches(4, seed=window):
            before = len(calls)
            a(x).square().mean().backward()
            b(x).square().mean().backward()
            per_backward.append(len(calls) - before)
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(p.grad, q.grad)
        norm = torch.cat([q.grad.reshape(-1) for q in b.parameters()]).norm()
        opt.step()
        if clip:
            torch.testing.assert_close(opt.last_grad_norm, norm, rtol=1e-6, atol=0)  # summation order
        opt.zero_grad()
        for q in b.parameters():
            q.grad = None
    in_hooks = 0 if hooks == "cpp" else n_buckets
    assert per_backward == [in_hooks] * 8


def test_dot_grad_follows_what_the_user_does_between_fast_middle_micro_batches(hooks):
    # The window re-exposes .grad and re-grants fast folds only when a slot's state changed
    # (its window's change counter, fold.Folder.changes), and the C++ hooks run middle backwards without Python only while nothing
    # did: clearing, replacing, editing in place and stepping between the middle micro-batches
    # must each still show torch's .grad after the next backward.
    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.0, accum_steps=6)  # lr=0: a and b stay equal
    ref = torch.optim.SGD(b.parameters(), lr=0.0)
    between = [
        lambda m: None,
        lambda m: setattr(m[0].weight, "grad", None),  # cleared: the next gradient starts anew
        lambda m: setattr(m[2].bias, "grad", torch.randn(5, generator=torch.Generator().manual_seed(9))),
        lambda m: m[0].bias.grad.mul_(0.5),  # in place: through to the sum
        lambda m: None,
    ]
    for i, x in enumerate(_batches(6, seed=3)):
        if i:
            for model in (a, b):
                between[i - 1](model)
        if i == 4:
            opt.step()  # mid-window: .grad keeps showing the sums, the next backward adds
            ref.step()
        a(x).square().sum().backward()
        b(x).square().sum().backward()
        for p, q in zip(a.parameters(), b.parameters()):
            # fp32 sums of the same gradients in the same order: bit for bit
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_what_a_backward_folded_before_it_raised_is_added_to_not_overwritten(hooks):
    # The first backward completes the second layer's bucket (an overwrite the C++ hooks do
    # themselves, which the window records at its next Python callback) and then raises: its
    # end never comes. The next backward folds that bucket in Python, which must record the
    # overwrite first and then add to it, as torch's .grad holds both gradients.
    def run(model, raising):
        x = _batches(1)[0]
        h = torch.tanh(model[0](x))
        if raising:
            h = RaiseWhenArmed.apply(h)
        return model[2](h).square().sum()

    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.1, bucket_cap_mb=13 * 5 * 4 / 2**20)  # a bucket per layer
    assert len(opt._window._folder.bucket_ids) >= 2
    for model in (a, b):
        RaiseWhenArmed.armed = True
        try:
            with pytest.raises(RuntimeError, match="planted error"):
                run(model, raising=True).backward()
        finally:
            RaiseWhenArmed.armed = False
        run(model, raising=False).backward()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)  # the same fp32 add either way
    assert opt.microbatches == 1


def _half_failing(model, x):
    return model[2](RaiseWhenArmed.apply(torch.tanh(model[0](x)))).square().mean()


@pytest.mark.parametrize("then", ["clip", "zero_grad"])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 13 * 5 * 4 / 2**20], ids=["one_bucket", "bucket_per_layer"])
def test_after_a_backward_that_raised_grad_holds_what_arrived_as_torchs_does(hooks, then, bucket_cap_mb):
    # Natively the head's gradients of the failed backward are in .grad (AccumulateGrad ran for
    # them before the error): a clip right after sees them; model.zero_grad() clears them and the
    # next backward starts anew. Before, they sat unfolded in a partly filled bucket (the clip
    # missed them: 1.8e-2 off), and zero_grad() went unnoticed (0.14 off). Three windows, so the
    # failure falls in a window's first and middle backward, where the C++ hooks may run quietly.
    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.25, bucket_cap_mb=bucket_cap_mb)
    ref = torch.optim.SGD(b.parameters(), lr=0.25)
    for window in range(3):
        xs = _batches(4, seed=window)
        for i, x in enumerate(xs):
            for model in (a, b):
                RaiseWhenArmed.armed = i == window
                try:
                    _half_failing(model, x).backward()
                except RuntimeError as error:
                    assert "planted error" in str(error)
                    if then == "zero_grad":
                        model.zero_grad()
                    else:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                finally:
                    RaiseWhenArmed.armed = False
            for p, q in zip(a.parameters(), b.parameters()):
                assert (p.grad is None) == (q.grad is None)
                if q.grad is not None:
                    # fp32 sums of the same gradients in the same order, clipped by the same
                    # torch code: bit for bit
                    torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)


def test_a_backward_past_accum_steps_after_the_norm_was_taken_invalidates_it(hooks):
    # The norm fused into the last pass describes values a further backward changes: it must be
    # recomputed (a fast fold may not skip that).
    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.0, accum_steps=2, max_grad_norm=1e9)
    for x in _batches(4):
        a(x).sum().backward()
        b(x).sum().backward()
    opt.step()
    norm = torch.cat([q.grad.reshape(-1) for q in b.parameters()]).norm()
    torch.testing.assert_close(opt.last_grad_norm, norm, rtol=1e-6, atol=0)


def _python_calls(monkeypatch, opt) -> list:
    """Counts the window's calls from the hooks (its once-per-backward callbacks)."""
    calls = []
    targets = [(type(opt._window), name) for name in ("_before_backward", "_queue_end_of_backward", "_end_of_backward")]
    targets.append((type(opt._window._folder), "bucket_complete"))
    for cls, name in targets:
        original = getattr(cls, name)

        def counted(self, *args, _original=original, **kwargs):
            calls.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("clip", [True, False])
def test_middle_backwards_run_without_python_and_still_count(cpp_hooks, monkeypatch, clip):
    # After the window's first backward the C++ hooks run the next ones alone (quiet): they
    # check what Python would, fold and count, and call nothing, the window's last backward
    # included (with clipping too: the step takes the norm from the buffers). The count, the
    # gradients and the step are torch's all the same.
    a, b = _pair()
    # plain SGD: ours and torch's round its update alike, so the models stay equal
    opt = fused_accum.SGD(
        a.parameters(), lr=0.25, accum_steps=4, max_grad_norm=1e9 if clip else None, bucket_cap_mb=50 * 4 / 2**20
    )
    ref = torch.optim.SGD(b.parameters(), lr=0.25)
    calls = _python_calls(monkeypatch, opt)
    per_backward = []
    for window in range(3):
        for i, x in enumerate(_batches(4, seed=window)):
            before = len(calls)
            a(x).square().mean().backward()
            per_backward.append(len(calls) - before > 0)
            b(x).square().mean().backward()
            assert opt.microbatches == i + 1
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(p.grad, q.grad)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    assert per_backward == [True, False, False, False] * 3


def test_another_optimizers_changes_leave_this_ones_quiet_backwards_alone(cpp_hooks, monkeypatch):
    # Each window counts changes to its own slots: a second optimizer whose window starts anew
    # between this one's backwards (its zero_grad, its first backward's folds) does not make
    # this one's middle backwards go through Python (a process-wide counter did).
    a, b = _pair()
    opt_a = fused_accum.SGD(a.parameters(), lr=0.25)
    opt_b = fused_accum.SGD(b.parameters(), lr=0.25)
    calls = _python_calls(monkeypatch, opt_a)
    per_backward = []
    for i, x in enumerate(_batches(4)):
        before = len(calls)
        a(x).square().mean().backward()
        per_backward.append(len(calls) - before > 0)
        b(x).square().mean().backward()
        opt_b.step()
        opt_b.zero_grad()  # b's window ends and starts again every backward
    assert per_backward == [True, False, False, False]
    assert opt_a.microbatches == 4


def test_a_quiet_backward_hands_its_end_to_python_when_a_parameter_got_no_gradient(cpp_hooks, monkeypatch):
    # Armed after the first backward, the third one leaves the last layer out: the one bucket
    # never completes, so that backward cannot end quietly. Its end goes to the window, which
    # folds what arrived (so .grad shows it at once, as torch's does) and counts it once.
    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.0)
    assert len(opt._window._folder.bucket_ids) == 1
    calls = _python_calls(monkeypatch, opt)
    per_backward = []
    for i, x in enumerate(_batches(5)):
        before = len(calls)
        for model in (a, b):
            (model[0](x) if i == 2 else model(x)).square().sum().backward()
        per_backward.append(len(calls) - before > 0)
        assert opt.microbatches == i + 1
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)  # the same fp32 adds
    assert per_backward == [True, False, True, False, False]


def test_a_reentrant_checkpoint_inside_a_quiet_backward_counts_once(cpp_hooks):
    # checkpoint(use_reentrant=True) runs a second backward inside the first: the outer one
    # cannot stay quiet; the window sees the outer end and counts one micro-batch per backward.
    from torch.utils.checkpoint import checkpoint

    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.0)
    for i, x in enumerate(_batches(4)):
        for model in (a, b):
            h = model[0](x)
            h = checkpoint(model[1:], h, use_reentrant=True) if i == 2 else model[1:](h)
            h.square().sum().backward()
        assert opt.microbatches == i + 1
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_layer_used_inside_and_outside_a_reentrant_checkpoint_sums_both_pieces(hooks):
    # The second layer runs inside a reentrant checkpoint and again outside it, each parameter
    # in a bucket of its own: its outer gradient arrives first (in the window's first backward,
    # written over the buffer), then the checkpoint's nested backward brings the inner one,
    # which is added to it, as torch adds both into .grad.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 5))
    b = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 5))
    b.load_state_dict(a.state_dict())
    ours = fused_accum.SGD(a.parameters(), lr=0.25, bucket_cap_mb=1e-6)
    assert len(ours._window._folder.bucket_ids) == 4
    ref = torch.optim.SGD(b.parameters(), lr=0.25)

    def forward(model, x):
        return model[1](checkpoint(model[1], model[0](x), use_reentrant=True).tanh())

    _windows_side_by_side(a, b, ours, ref, forward=forward, same_grads=True)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def _backwards_on_threads(params, opt, *, windows, threads, rounds):
    """Each window: ``threads`` threads call backward() on the same parameters at once,
    ``rounds`` times each, then one step. Every gradient is an integer-valued fp32 tensor, so
    every sum is exact in any order: the result does not depend on how the threads interleave."""
    g = torch.Generator().manual_seed(1)
    for _ in range(windows):
        coefs = [[torch.randint(-3, 4, p.shape, generator=g).float() for p in params] for _ in range(threads)]
        barrier, errors = threading.Barrier(threads), []

        def backwards(cs):
            try:
                for r in range(rounds):
                    barrier.wait()
                    sum(((r + 1) * c * p).sum() for c, p in zip(cs, params)).backward()
            except BaseException as e:  # (reported below, on the test's thread)
                errors.append(e)
                barrier.abort()

        # (daemon threads joined with a deadline: a deadlock of the hooks' lock and the GIL fails
        # the test instead of hanging the suite; a window takes well under a second here)
        workers = [threading.Thread(target=backwards, args=(cs,), daemon=True) for cs in coefs]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
        assert not any(w.is_alive() for w in workers), "backward threads deadlocked"
        assert not errors, errors
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("per_bucket, accum_steps", [(1, None), (2, 6)], ids=["bucket_each", "buckets_of_two_known_k"])
def test_backwards_on_several_threads_at_once_sum_every_gradient(hooks, per_bucket, accum_steps):
    # Three threads call backward() on one model at once (each its own graph), as torch allows:
    # torch adds every gradient into .grad under the node's lock, and so must the window, its
    # fast folds included. Large parameters (2**18 floats: a fold takes long enough for the
    # threads' folds of one bucket to meet) and 12 windows: a fold racing another loses a
    # gradient in practically every run; here, as the sums are exact, none may.
    size, windows, threads, rounds = 2**18, 12, 3, 2

    def params():
        torch.manual_seed(0)
        return [nn.Parameter(torch.randn(size)) for _ in range(4)]

    ref = params()
    _backwards_on_threads(ref, torch.optim.SGD(ref, lr=2**-10), windows=windows, threads=threads, rounds=rounds)
    ours = params()
    opt = fused_accum.SGD(ours, lr=2**-10, accum_steps=accum_steps, bucket_cap_mb=per_bucket * size * 4 / 2**20)
    assert len(opt._window._folder.bucket_ids) == 4 // per_bucket
    _backwards_on_threads(ours, opt, windows=windows, threads=threads, rounds=rounds)
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)  # exact sums; SGD steps them alike


@pytest.mark.parametrize("restart", ["step", "load_state_dict"])
def test_the_last_backward_is_found_after_the_count_was_set(cpp_hooks, restart):
    # Quiet backwards are armed up to the window's last backward (which takes the norm). A step
    # mid-window starts the count anew; a checkpoint loaded mid-window sets it back, with the
    # sums it saved. The count, the gradients and the norm stay torch's.
    a, b = _pair()
    opt = fused_accum.SGD(a.parameters(), lr=0.0, accum_steps=4, max_grad_norm=1e9)
    xs = iter(_batches(8))

    def backward():
        x = next(xs)
        a(x).square().sum().backward()
        b(x).square().sum().backward()

    backward()
    backward()
    if restart == "step":
        opt.step()  # lr=0: .grad keeps its sums, the next backward adds; the count starts anew
        left = 4
    else:
        state, saved = opt.state_dict(), [q.grad.clone() for q in b.parameters()]
        backward()
        opt.load_state_dict(state)
        for q, g in zip(b.parameters(), saved):
            q.grad = g
        left = 2
    assert opt.microbatches == 4 - left
    for _ in range(left):
        backward()
    assert opt.microbatches == 4
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)  # the same fp32 adds
    norm = torch.cat([q.grad.reshape(-1) for q in b.parameters()]).norm()
    opt.step()
    torch.testing.assert_close(opt.last_grad_norm, norm, rtol=1e-6, atol=0)  # summation order
