"""The custom ops of fused_accum/ops.py: schemas, fake implementations and torch.compile.

``torch.library.opcheck`` verifies that each op's schema declares exactly what it mutates,
that its fake implementation matches, and that it works under autograd and FakeTensor
tracing; ``torch.compile(fullgraph=True)`` then proves a step that calls the ops traces
without a graph break. Run on the reference backend (the kernel backends register their own
ops, checked in their own tests).
"""

import pytest
import torch

from fused_accum import ops
from dispatch_record import RecordOps  # tests/dispatch_record.py


def _adam_args(n=5, with_grads=False):
    """(the accumulator buffer, adam_step_'s arguments for two tensors of n whose accs are the
    two halves of that buffer)."""
    gen = torch.Generator().manual_seed(0)
    t = lambda: torch.randn(n, generator=gen)  # noqa: E731
    acc = torch.randn(2 * n, generator=gen)
    params, m, v, accs = [t(), t()], [t(), t()], [t().abs(), t().abs()], [acc[:n], acc[n:]]
    grads = [t().bfloat16(), t().bfloat16()] if with_grads else []
    lr = torch.tensor(0.01, dtype=torch.float64)  # as the optimizer passes it (FlatGroup.lr)
    return acc, (
        params,
        m,
        v,
        [],
        accs,
        torch.tensor([1.0, 3.0]),
        lr,
        torch.tensor(0.5),
        0.9,
        0.99,
        1e-8,
        0.01,
        True,
        False,
        [],
        grads,
        1.0,
        False,
        torch.zeros(()),
        "reference",
    )


def test_opcheck_accumulate():
    gen = torch.Generator().manual_seed(0)
    acc, offsets = torch.randn(12, generator=gen), torch.tensor([0, 8])
    grads = [torch.randn(7, generator=gen).half(), torch.randn(3, generator=gen)]
    args = (acc, offsets, grads, 0.5, False, torch.zeros(()), torch.zeros(()), "reference")
    torch.library.opcheck(ops.accumulate_, args)


@pytest.mark.parametrize("with_grads", [False, True])
def test_opcheck_adam(with_grads):
    torch.library.opcheck(ops.adam_step_, _adam_args(with_grads=with_grads)[1])


def test_opcheck_sgd_and_lion():
    gen = torch.Generator().manual_seed(1)
    t = lambda: [torch.randn(4, generator=gen)]  # noqa: E731
    common = (torch.tensor([2.0]), torch.tensor(0.1, dtype=torch.float64), torch.tensor(1.0))
    torch.library.opcheck(
        ops.sgd_step_,
        (
            t(),
            t(),
            t(),
            *common,
            0.9,
            0.0,
            0.0,
            True,
            False,
            [torch.empty(4, dtype=torch.bfloat16)],
            [],
            1.0,
            False,
            None,
            "reference",
        ),
    )
    torch.library.opcheck(
        ops.lion_step_, (t(), t(), t(), *common, 0.9, 0.99, 0.1, False, [], [], 1.0, False, None, "reference")
    )


def test_compiled_step_has_no_graph_break():
    acc, args = _adam_args()
    offsets = torch.tensor([0, 5])

    def accumulate_then_step(grads):  # the names the optimizer calls: custom ops when traced
        ops.accumulate(acc, offsets, grads, 1.0, False, None, None, "reference")
        ops.adam_step(*args)

    grads = [torch.randn(5), torch.randn(5)]
    explanation = torch._dynamo.explain(accumulate_then_step)(grads)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    traced_ops = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    assert {"fused_accum.accumulate_.default", "fused_accum.adam_step_.default"} <= traced_ops, traced_ops
    before = [p.clone() for p in args[0]]
    torch.compile(accumulate_then_step, backend="aot_eager", fullgraph=True)(grads)
    assert not any(torch.equal(p, b) for p, b in zip(args[0], before))  # the step really ran


def test_eager_calls_skip_the_custom_op_wrapper():
    """Eager calls go straight to the backend (the wrapper costs ~30 us a call); a dispatch
    mode records which ops reach the dispatcher."""
    acc, offsets, grad = torch.zeros(3), torch.zeros(1, dtype=torch.int64), torch.ones(3)
    with RecordOps() as eager:
        ops.accumulate(acc, offsets, [grad], 2.0, True, None, None, "reference")
    with RecordOps() as wrapped:
        ops.accumulate_(acc, offsets, [grad], 2.0, True, None, None, "reference")
    assert not any(op.startswith("fused_accum.") for op in eager.ops), eager.ops
    assert "fused_accum.accumulate_.default" in wrapped.ops  # the mode does see custom ops
    assert torch.equal(acc, torch.full((3,), 2.0))
