"""The custom ops of fused_accum/ops.py: their declarations, schemas, fake implementations and
torch.compile.

Each op's arguments are declared once (fused_accum.ops: Accumulate; StepTensors, the op's
states record and its hyper-parameter record); the registered schemas of both namespaces, the
custom ops ``fused_accum::*`` and the C++ extension's ``fused_accum_ext::*``, are checked
against those declarations, and a C++ kernel that does not take the declared arguments is
refused. ``torch.library.opcheck`` verifies that each op's schema declares exactly what it
mutates, that its fake implementation matches, and that it works under autograd and FakeTensor
tracing; ``torch.compile(fullgraph=True)`` then proves a step that calls the ops traces without a
graph break. Run on the reference backend (the kernel backends' own ops are checked in their own
tests).
"""

import importlib
import importlib.util
import inspect
import subprocess
import sys
import textwrap
from typing import NamedTuple, Optional

import pytest
import torch

from fused_accum import backends, ops, registry
from fused_accum.algorithms import AdamHyper, LionHyper, SgdHyper
from fused_accum.extension import _C
from dispatch_record import RecordOps  # tests/dispatch_record.py


def _adam_records(n=5, with_grads=False):
    """(the accumulator buffer, adam_step's records for two tensors of n whose accs are the two
    halves of that buffer)."""
    gen = torch.Generator().manual_seed(0)
    t = lambda: torch.randn(n, generator=gen)  # noqa: E731
    acc = torch.randn(2 * n, generator=gen)
    params, m, v, accs = [t(), t()], [t(), t()], [t().abs(), t().abs()], [acc[:n], acc[n:]]
    grads = [t().bfloat16(), t().bfloat16()] if with_grads else []
    lr = torch.tensor(0.01, dtype=torch.float64)  # as the optimizer passes it (FlatGroup.lr)
    tensors = ops.StepTensors(
        params, accs, torch.tensor([1.0, 3.0]), lr, torch.tensor(0.5), grads=grads, found_inf=torch.zeros(())
    )
    return acc, (tensors, ops.adam_step.states(m, v, []), AdamHyper(0.9, 0.99, 1e-8, 0.01, True, False))


def _flat(op, records, backend="reference"):
    """The custom op's positional arguments for ``records``."""
    return (*op.flatten(*records), backend)


def test_opcheck_accumulate():
    gen = torch.Generator().manual_seed(0)
    acc, offsets = torch.randn(12, generator=gen), torch.tensor([0, 8])
    grads = [torch.randn(7, generator=gen).half(), torch.randn(3, generator=gen)]
    args = (acc, offsets, grads, 0.5, False, torch.zeros(()), torch.zeros(()), "reference")
    torch.library.opcheck(ops.accumulate_, args)


@pytest.mark.parametrize("with_grads", [False, True])
def test_opcheck_adam(with_grads):
    torch.library.opcheck(ops.adam_step_, _flat(ops.adam_step, _adam_records(with_grads=with_grads)[1]))


def test_opcheck_sgd_and_lion():
    gen = torch.Generator().manual_seed(1)
    t = lambda: [torch.randn(4, generator=gen)]  # noqa: E731
    common = (torch.tensor([2.0]), torch.tensor(0.1, dtype=torch.float64), torch.tensor(1.0))
    sgd = (
        ops.StepTensors(t(), t(), *common, lp_params=[torch.empty(4, dtype=torch.bfloat16)]),
        ops.sgd_step.states(t()),
        SgdHyper(0.9, 0.0, 0.0, True, False),
    )
    torch.library.opcheck(ops.sgd_step_, _flat(ops.sgd_step, sgd))
    lion = (ops.StepTensors(t(), t(), *common), ops.lion_step.states(t()), LionHyper(0.9, 0.99, 0.1, False))
    torch.library.opcheck(ops.lion_step_, _flat(ops.lion_step, lion))


def test_opcheck_remainders():
    """The remainder mode writes its bf16 params and int16 remainders: the schema declares both
    (opcheck fails an op that mutates an argument its schema does not mark)."""
    gen = torch.Generator().manual_seed(2)
    t = lambda: [torch.randn(6, generator=gen)]  # noqa: E731
    params = [torch.randn(6, generator=gen).bfloat16()]
    remainders = [torch.randint(-(2**15), 2**15, (6,), generator=gen, dtype=torch.int16)]
    common = (torch.tensor([2.0]), torch.tensor(0.1, dtype=torch.float64), torch.tensor(1.0))
    adam = (
        ops.StepTensors(params, t(), *common, remainders=remainders),
        ops.adam_step.states(t(), [x.abs() for x in t()]),
        AdamHyper(0.9, 0.99, 1e-8, 0.01, True, False),
    )
    torch.library.opcheck(ops.adam_step_, _flat(ops.adam_step, adam))


def test_compiled_step_has_no_graph_break():
    acc, records = _adam_records()
    offsets = torch.tensor([0, 5])

    def accumulate_then_step(grads):  # the names the optimizer calls: custom ops when traced
        ops.accumulate(acc, offsets, grads, 1.0, False, None, None, "reference")
        ops.adam_step(*records, "reference")

    grads = [torch.randn(5), torch.randn(5)]
    explanation = torch._dynamo.explain(accumulate_then_step)(grads)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    traced_ops = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    assert {"fused_accum.accumulate_.default", "fused_accum.adam_step_.default"} <= traced_ops, traced_ops
    params = records[0].params
    before = [p.clone() for p in params]
    torch.compile(accumulate_then_step, backend="aot_eager", fullgraph=True)(grads)
    assert not any(torch.equal(p, b) for p, b in zip(params, before))  # the step really ran


def test_eager_calls_skip_the_custom_op_wrapper():
    """Eager calls go straight to the backend (the wrapper costs ~30 us a call); a dispatch
    mode records which ops reach the dispatcher."""
    acc, offsets, grad = torch.zeros(3), torch.zeros(1, dtype=torch.int64), torch.ones(3)
    with RecordOps() as eager:
        ops.accumulate(acc, offsets, [grad], 2.0, True, None, None, "reference")
        ops.adam_step(*_adam_records()[1], "reference")
    with RecordOps() as wrapped:
        ops.accumulate_(acc, offsets, [grad], 2.0, True, None, None, "reference")
        ops.adam_step_(*_flat(ops.adam_step, _adam_records()[1]))
    assert not any(op.startswith("fused_accum.") for op in eager.ops), eager.ops
    assert {"fused_accum.accumulate_.default", "fused_accum.adam_step_.default"} <= set(wrapped.ops)
    assert torch.equal(acc, torch.full((3,), 2.0))


# --- the declarations --------------------------------------------------------------------------

# accumulate_'s schema, pinned: csrc/hooks.cpp (fold_into) calls fused_accum_ext::accumulate_
# through the dispatcher with the typed signature (const Tensor&, const Tensor&, TensorList,
# double, bool, const optional<Tensor>&, const optional<Tensor>&), checked only when a backward
# first folds in C++. Change both together.
ACCUMULATE_SCHEMA = (
    "accumulate_(Tensor(a!) acc, Tensor offsets, Tensor[] grads, float alpha, bool overwrite, "
    "Tensor(b!)? found_inf, Tensor(c!)? sumsq) -> ()"
)


# The step ops' schemas, pinned: the C++ kernels (csrc/bindings.h) take these arguments, in this
# order and of these types; the records in fused_accum/algorithms.py declare them (a change to a
# record changes its op's schema: change the C++ parameters with it).
STEP_SCHEMAS = {
    "sgd_step_": (
        "sgd_step_(Tensor(a!)[] params, Tensor[] accs, Tensor steps, Tensor lr, Tensor coef, Tensor(b!)[] lp_params, "
        "Tensor(c!)[] remainders, Tensor[] grads, Tensor? found_inf, float grad_alpha, bool grads_overwrite, "
        "Tensor[] sources, Tensor(d!)[] momentum_buffers, float momentum, float dampening, float weight_decay, "
        "bool nesterov, bool maximize) -> ()"
    ),
    "adam_step_": (
        "adam_step_(Tensor(a!)[] params, Tensor[] accs, Tensor steps, Tensor lr, Tensor coef, Tensor(b!)[] lp_params, "
        "Tensor(c!)[] remainders, Tensor[] grads, Tensor? found_inf, float grad_alpha, bool grads_overwrite, "
        "Tensor[] sources, Tensor(d!)[] exp_avgs, Tensor(e!)[] exp_avg_sqs, Tensor(f!)[] max_exp_avg_sqs, "
        "float beta1, float beta2, float eps, float weight_decay, bool decoupled, bool maximize) -> ()"
    ),
    "lion_step_": (
        "lion_step_(Tensor(a!)[] params, Tensor[] accs, Tensor steps, Tensor lr, Tensor coef, Tensor(b!)[] lp_params, "
        "Tensor(c!)[] remainders, Tensor[] grads, Tensor? found_inf, float grad_alpha, bool grads_overwrite, "
        "Tensor[] sources, Tensor(d!)[] exp_avgs, float beta1, float beta2, float weight_decay, bool maximize) -> ()"
    ),
    "adagrad_step_": (
        "adagrad_step_(Tensor(a!)[] params, Tensor[] accs, Tensor steps, Tensor lr, Tensor coef, "
        "Tensor(b!)[] lp_params, Tensor(c!)[] remainders, Tensor[] grads, Tensor? found_inf, float grad_alpha, "
        "bool grads_overwrite, Tensor[] sources, Tensor(d!)[] sums, float lr_decay, float weight_decay, float eps, "
        "bool maximize) -> ()"
    ),
    "ademamix_step_": (
        "ademamix_step_(Tensor(a!)[] params, Tensor[] accs, Tensor steps, Tensor lr, Tensor coef, "
        "Tensor(b!)[] lp_params, Tensor(c!)[] remainders, Tensor[] grads, Tensor? found_inf, float grad_alpha, "
        "bool grads_overwrite, Tensor[] sources, Tensor(d!)[] exp_avgs, Tensor(e!)[] exp_avg_sqs, "
        "Tensor(f!)[] exp_avg_slows, float beta1, float beta2, float beta3, float alpha, float? t_alpha_beta3, "
        "float eps, float weight_decay, bool maximize) -> ()"
    ),
}


def test_the_step_schemas_are_the_pinned_ones():
    """Made from the algorithms' records, each existing op's schema is what the C++ kernels were
    written against, to the character."""
    declared = ops.ext_schemas()
    for name, text in STEP_SCHEMAS.items():
        assert declared[name] == text, name


def test_schemas_follow_the_declarations():
    """Each step op's schema is StepTensors' fields, its states' and its hyper-parameters', in
    that order, each written list with an alias set of its own; accumulate's is pinned."""
    declared = ops.ext_schemas()
    # every step op, and each split step's prologue and epilogue (Muon's)
    kernel_ops = {op.name for op in ops.kernel_ops()}
    assert kernel_ops == {*ops.STEP_OPS, "muon_prologue", "muon_epilogue"}
    assert set(declared) == {"accumulate_", "fold_pieces_", *(f"{name}_" for name in kernel_ops)}
    assert declared["accumulate_"] == ACCUMULATE_SCHEMA
    assert declared["fold_pieces_"] == "fold_pieces_(Tensor(a!) acc, Tensor[] pieces, bool overwrite) -> ()"
    # the epilogue reads the middle's output: its one list is not written
    read = {"muon_epilogue": {"updates"}}
    for op in ops.kernel_ops():
        fields = (*ops.StepTensors._fields, *op.states._fields, *op.hyper._fields)
        assert tuple(a.name for a in op.arguments) == fields
        written = {a.name for a in op.arguments if a.written}
        assert written == {"params", "lp_params", "remainders", *op.states._fields} - read.get(op.name, set())
        assert declared[f"{op.name}_"].startswith(
            f"{op.name}_(Tensor(a!)[] params, Tensor[] accs, Tensor steps, Tensor lr, Tensor coef, "
            "Tensor(b!)[] lp_params, Tensor(c!)[] remainders, Tensor[] grads, Tensor? found_inf, "
            "float grad_alpha, bool grads_overwrite, Tensor[] sources, "
        )
        # torch's state key of each list (opt.state[p][key]), which the step reads
        assert all(f"{key}s" == name for key, name in zip(op.state_keys, op.states._fields))
    assert ops.step_op("adamw") is ops.step_op("adam") is ops.adam_step


def test_a_hyper_parameter_that_may_be_none_is_an_optional_float():
    """A record's Optional[float] field (AdEMAMix's t_alpha_beta3=None) is the schema's ``float?``
    (the C++ kernel's std::optional<double>), and a group's None reaches the record as None, a
    number (or a one-element tensor) as a float."""

    class Hyper(NamedTuple):
        warmup: Optional[float]
        beta: float
        flag: bool

    assert [(a.name, a.type) for a in ops.arguments(Hyper)] == [
        ("warmup", "float?"),
        ("beta", "float"),
        ("flag", "bool"),
    ]
    assert ops.schema("f", ops.arguments(Hyper)) == "f(float? warmup, float beta, bool flag) -> ()"
    read = lambda group: registry.read_hyper(Hyper, "sgd", group)  # noqa: E731 (sgd: no renamed fields)
    assert read(dict(warmup=None, beta=torch.tensor(0.5), flag=1)) == (None, 0.5, True)
    got = read(dict(warmup=3, beta=1, flag=0))
    assert got == (3.0, 1.0, False) and type(got.warmup) is float


def test_registered_schemas_are_the_declared_ones():
    """What torch's dispatcher holds, for both namespaces: the custom ops (plus the backend's
    name) and the C++ extension's operators, whose kernels the dispatcher accepted under the
    declared schema (it refuses other parameter types: see the next test)."""
    for name, text in ops.ext_schemas().items():
        custom = str(getattr(torch.ops.fused_accum, name).default._schema)
        assert custom == "fused_accum::" + text.replace(") -> ()", ", str backend) -> ()")
    if _C is None:
        pytest.skip("the C++ extension is not built: only the custom ops are registered")
    from fused_accum.backends import ext

    assert ext.unavailable_reason("cpu") == "", ext.unavailable_reason("cpu")  # the kernels were accepted
    for name, text in ops.ext_schemas().items():
        assert str(getattr(torch.ops.fused_accum_ext, name).default._schema) == "fused_accum_ext::" + text
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fused_accum_ext::{name}", "CPU"), name


# A process in which the declaration and _C's kernels disagree: an argument added to a step op
# (as issue 28's int16 remainders were added to all) without its C++ parameter.
_DRIFT = textwrap.dedent(
    """
    import warnings
    from typing import NamedTuple
    from fused_accum import ops
    from fused_accum.algorithms import AdamHyper
    class States(NamedTuple):
        exp_avgs: ops.WrittenLists
        exp_avg_sqs: ops.WrittenLists
        max_exp_avg_sqs: ops.WrittenLists = ()
        undeclared_in_cpp: ops.WrittenLists = ()
    ops.STEP_OPS["adam_step"].arguments = ops.arguments(ops.StepTensors, States, AdamHyper)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from fused_accum.backends import ext
    print(ext.unavailable_reason("cpu"))
    print(len(caught), caught[0].category.__name__ if caught else "")
    """
)


@pytest.mark.skipif(_C is None, reason="the C++ extension is not built")
def test_kernels_that_drift_from_the_declaration_are_refused():
    """Declared arguments the C++ kernel does not take: the dispatcher refuses the schema, the
    cpu backend is unavailable with the dispatcher's reason, and one warning says to rebuild."""
    out = subprocess.run([sys.executable, "-c", _DRIFT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    why, warned = out.stdout.strip().splitlines()[-2:]
    assert "fused_accum._C's kernels do not take the arguments fused_accum.ops declares" in why, why
    assert "fused_accum_ext::adam_step_" in why and "undeclared_in_cpp" in why, why
    assert "pip install --no-build-isolation" in why, why  # how to rebuild
    assert warned == "1 RuntimeWarning", warned


def _backend_modules() -> dict:
    """The backend modules importable here, by name (triton's imports without the interpreter)."""
    modules = {"reference": backends.get("reference")}
    if _C is not None:
        modules["cpu"] = importlib.import_module("fused_accum.backends.ext")
    if importlib.util.find_spec("triton") is not None:
        modules["triton"] = importlib.import_module("fused_accum.backends.triton")
    return modules


def test_accumulate_signatures_follow_the_declaration():
    """accumulate keeps flat arguments (the per-micro-batch call): ops.accumulate takes the
    declaration's fields, then the backend and plan=; each backend's function the fields (and
    plan= where the registry says)."""
    fields = list(ops.Accumulate._fields)
    assert list(inspect.signature(ops.accumulate).parameters) == [*fields, "backend", "plan"]
    for name, module in _backend_modules().items():
        plan = ["plan"] if backends.takes_plan(name) else []
        assert list(inspect.signature(module.accumulate).parameters) == [*fields, *plan], name


def test_fold_pieces_signatures_follow_the_declaration():
    """fold_pieces takes FoldPieces' fields flat: ops.fold_pieces then the backend, each backend's
    function the fields alone (no plan=: nothing of a call is cached)."""
    fields = list(ops.FoldPieces._fields)
    assert list(inspect.signature(ops.fold_pieces).parameters) == [*fields, "backend"]
    for name, module in _backend_modules().items():
        assert list(inspect.signature(module.fold_pieces).parameters) == fields, name


def test_backends_take_the_step_records():
    """Each backend's one step function takes the op and its three records (and plan= where the
    registry says); the reference specifies each op in a function of the op's name."""
    for name, module in _backend_modules().items():
        plan = ["plan"] if backends.takes_plan(name) else []
        assert list(inspect.signature(module.step).parameters) == ["op", "t", "s", "h", *plan], name
    for op in ops.kernel_ops():
        assert list(inspect.signature(getattr(backends.get("reference"), op.name)).parameters) == ["t", "s", "h"]


def test_records_and_states_of():
    """The flat keyword form of an op's arguments, and the states record a step builds from its
    slots' buffers (a list per key the group keeps now, empty for the others)."""
    t, s, h = ops.adam_step.records(
        params=[1], accs=[2], steps=3, lr=4, coef=5, exp_avgs=[6], exp_avg_sqs=[7], **AdamHyper(*range(6))._asdict()
    )
    assert t == ops.StepTensors([1], [2], 3, 4, 5) and s == ops.adam_step.states([6], [7]) and h == AdamHyper(*range(6))
    with pytest.raises(TypeError, match="unexpected arguments"):
        ops.lion_step.records(eps=1.0)
    buffers = [{"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 3}, {"exp_avg": 4, "exp_avg_sq": 5}]
    assert ops.adam_step.states_of(buffers, ("exp_avg", "exp_avg_sq")) == ops.adam_step.states([1, 4], [2, 5], [])
    assert ops.sgd_step.states_of([{}, {}], ()) == ops.sgd_step.states([])
