"""Loop B: stack the outputs of k micro-batches, compute the loss once, backward once.

Loop A (``loss_j.backward()`` per micro-batch, the normal accumulation loop) is exact only when
the loss is a sum or mean of per-sample terms. A loss that couples samples across the batch
(InfoNCE with in-batch negatives, ranking, batch-normalised losses) needs every sample's output
before it can be computed; this module holds the two ways to do that:

* :func:`stacked_backward` -- forward every chunk with autograd, concatenate, one loss, one
  backward. Exact, but all k autograd graphs stay alive until that backward, so it saves no
  activation memory over the large batch (the reference form).
* :func:`cached_backward` -- the memory-bounded form ("gradient caching"): forward every chunk
  under ``no_grad``, compute the loss on the concatenated outputs and its gradient with respect
  to them, then re-forward each chunk with autograd, replaying the CPU and CUDA RNG state it saw
  the first time (so dropout draws the same masks), and backpropagate that chunk's slice of the
  cached gradient. The parameter gradients equal the stacked form's (up to fp32 summation
  order), while only one chunk's activations are saved at a time, for about one extra forward.

Both only call ``backward()``: the gradients land in ``.grad`` for any torch optimizer, and in the
fp32 accumulation buffers of a :class:`~fused_accum.FusedAccumOptimizer` through its hooks, which
count one micro-batch per backward that reaches a parameter. ``stacked_backward`` runs one
backward (``accum_steps=1``); ``cached_backward`` runs exactly one per chunk (``accum_steps=k``):
the gradient with respect to the outputs is taken with ``torch.autograd.grad``, which touches no
parameter, and parameters the loss itself owns (a learnable temperature) get theirs in the first
chunk's backward.

Inputs and outputs may be tensors or nested tuples/lists/dicts of tensors (any pytree), e.g. a
dual encoder taking ``(queries, documents)`` and returning two embeddings. Run either function
inside ``torch.autocast`` to get mixed precision: forwards, replays and the loss all run in the
caller's autocast state. Stateful layers see every chunk twice in the cached form (BatchNorm
running statistics are updated twice, and normalise per chunk in both forms).

:class:`SavedActivationMeter` measures what autograd saves for backward (bytes, live and peak)
with ``torch.autograd.graph.saved_tensors_hooks``, the device-independent memory figure the tests
and the demo use to compare the loops.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor
from torch.utils import _pytree as pytree  # also handles registered nodes, e.g. HF ModelOutput

__all__ = [
    "SavedActivationMeter",
    "cached_backward",
    "concat_outputs",
    "split_batch",
    "stacked_backward",
]


def split_batch(batch: Any, chunks: int) -> list[Any]:
    """Split every tensor of ``batch`` (a tensor or pytree of tensors) into ``chunks`` parts along
    dim 0, as :func:`torch.tensor_split` does (sizes differ by at most one); one pytree per part."""
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    leaves, spec = pytree.tree_flatten(batch)
    for leaf in leaves:
        if not isinstance(leaf, Tensor) or leaf.dim() == 0:
            raise TypeError(f"batch leaves must be tensors with a batch dim, got {_describe(leaf)}")
    parts = [torch.tensor_split(leaf, chunks) for leaf in leaves]
    return [pytree.tree_unflatten([p[j] for p in parts], spec) for j in range(chunks)]


def concat_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate per-chunk outputs (tensors or identically shaped pytrees) along dim 0."""
    flat, spec = _flatten_all(outputs, "outputs")
    return pytree.tree_unflatten([_cat_leaf([leaves[i] for leaves in flat], i) for i in range(len(flat[0]))], spec)


def stacked_backward(model_fn: Callable[..., Any], chunks: Iterable[Any], loss_fn: Callable[[Any], Tensor]) -> Tensor:
    """Loop B as usually written: keep every chunk's graph, concatenate the outputs, compute
    ``loss_fn`` once and call ``backward()`` once. Returns the loss, detached.

    ``model_fn`` is called as ``model_fn(*chunk)`` for a tuple/list chunk, ``model_fn(**chunk)``
    for a dict and ``model_fn(chunk)`` otherwise. Peak saved activations: all k chunks.
    """
    chunks = _as_list(chunks)
    loss = loss_fn(concat_outputs([_call(model_fn, chunk) for chunk in chunks]))
    _check_loss(loss)
    loss.backward()
    return loss.detach()


def cached_backward(model_fn: Callable[..., Any], chunks: Iterable[Any], loss_fn: Callable[[Any], Tensor]) -> Tensor:
    """Loop B with bounded memory (gradient caching): the same loss and parameter gradients as
    :func:`stacked_backward`, saving the activations of one chunk at a time.

    Same calling convention as :func:`stacked_backward`. Cost: one extra forward per chunk, plus
    the concatenated outputs and their gradient (batch x output size) kept for the whole call.
    ``model_fn`` must be deterministic given the RNG state (dropout is; see the module doc for
    stateful layers). The global RNG ends where the stacked form leaves it (after the k forwards and
    any draws of ``loss_fn``).
    """
    chunks = _as_list(chunks)

    # 1. Forward every chunk without a graph, remembering the RNG state each one started from.
    rng_states, outputs = [], []
    with torch.no_grad():
        for chunk in chunks:
            rng_states.append(_RngState())
            outputs.append(_call(model_fn, chunk))
    flat, spec = _flatten_all(outputs, "outputs")
    del outputs

    # 2. Loss on the concatenated outputs, made leaves so backward stops at them.
    reps = []
    for i in range(len(flat[0])):
        rep = _cat_leaf([leaves[i] for leaves in flat], i).detach()  # never flag a caller tensor
        reps.append(rep.requires_grad_() if rep.is_floating_point() or rep.is_complex() else rep)
    shapes = [[leaf.shape for leaf in leaves] for leaves in flat]
    del flat  # the chunk outputs now live in reps only
    loss = loss_fn(pytree.tree_unflatten(reps, spec))
    _check_loss(loss)
    # Where the stacked form's RNG would be now (after the forwards and any draws of the loss):
    # restored at the end, after the replays have drawn again.
    rng_after = _RngState()
    # The gradient with respect to the outputs only: no parameter's .grad (and no optimizer
    # hook) is touched, so the call is one backward per chunk. When the loss owns parameters
    # (a learnable temperature), its graph is kept for the first chunk's backward, which then
    # also carries their gradient; otherwise it is freed here.
    loss_owns_params = _reaches_other_leaves(loss, reps)
    wanted = [i for i, rep in enumerate(reps) if rep.requires_grad]
    found = torch.autograd.grad(loss, [reps[i] for i in wanted], retain_graph=loss_owns_params, allow_unused=True)
    rep_grads = [None] * len(reps)
    for i, grad in zip(wanted, found):
        rep_grads[i] = grad

    # 3. Re-forward each chunk with a graph, replaying its RNG, and push its slice of the
    #    cached gradient through it; its saved activations are freed by that backward.
    starts = [0] * len(rep_grads)
    for j, (chunk, first_shapes, rng) in enumerate(zip(chunks, shapes, rng_states)):
        rng.restore()
        leaves, _ = pytree.tree_flatten(_call(model_fn, chunk))
        if len(leaves) != len(first_shapes):
            raise RuntimeError("model_fn returned a different output structure when re-run")
        roots, grads = [], []
        for i, (leaf, shape) in enumerate(zip(leaves, first_shapes)):
            if not isinstance(leaf, Tensor) or leaf.shape != shape:
                raise RuntimeError(
                    f"model_fn output {i} changed on the replay: shape {tuple(shape)} -> "
                    f"{_describe(leaf)}; it must be deterministic given the RNG state"
                )
            n = leaf.shape[0]
            if rep_grads[i] is not None and leaf.requires_grad:
                roots.append(leaf)
                grads.append(rep_grads[i][starts[i] : starts[i] + n])
            starts[i] += n
        if j == 0 and loss_owns_params:  # (this also re-derives the outputs' gradient: cheap)
            roots.append(loss)
            grads.append(None)
        if roots:
            torch.autograd.backward(roots, grads)
        del leaves, roots, grads
    rng_after.restore()
    return loss.detach()


class SavedActivationMeter:
    """Bytes that autograd saves for backward while the meter is entered: ``live`` now and
    ``peak`` so far. Device independent (a count of tensor storage, not an allocator query).

    Each storage counts once however many saved views share it; storages of ``exclude`` tensors
    (pass the model's parameters) are not counted, so the figure is activations only. A saved
    tensor stops counting when autograd releases it (after the backward through its graph, or
    when the graph is dropped).
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._refs: dict[int, int] = {}  # storage key -> saved tensors holding it
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: Tensor) -> Any:
        key = _storage_key(tensor)
        if key in self._excluded:
            return tensor
        if self._refs.get(key, 0) == 0:
            self.live += _storage_bytes(tensor)
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        # Hold a detached alias: the tensor itself may be an output of the node saving it, and
        # holding it would make a cycle (tensor -> grad_fn -> saved -> tensor) only gc frees.
        return _Saved(tensor.detach(), self, key)

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= nbytes


class _Saved:
    """What autograd holds instead of a saved tensor; freeing it un-counts the storage."""

    __slots__ = ("tensor", "_meter", "_key", "_nbytes")

    def __init__(self, tensor: Tensor, meter: SavedActivationMeter, key: int) -> None:
        self.tensor, self._meter, self._key = tensor, meter, key
        self._nbytes = _storage_bytes(tensor)

    def __del__(self) -> None:
        self._meter._release(self._key, self._nbytes)


def _reaches_other_leaves(loss: Tensor, reps: Sequence[Tensor]) -> bool:
    """Whether the loss's graph ends in a leaf that requires grad other than ``reps``: a
    parameter owned by the loss. Walks the loss's own graph only (it stops at the leaves)."""
    own = {id(rep) for rep in reps}
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None and id(variable) not in own:
            return True
        todo.extend(next_node for next_node, _ in node.next_functions)
    return False


class _RngState:
    """The CPU generator and, once CUDA is initialised, every CUDA generator (16 bytes each):
    what dropout draws from. Other device types (MPS, XPU) are not replayed."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _call(model_fn: Callable[..., Any], chunk: Any) -> Any:
    if isinstance(chunk, dict):
        return model_fn(**chunk)
    if isinstance(chunk, (tuple, list)):
        return model_fn(*chunk)
    return model_fn(chunk)


def _as_list(chunks: Iterable[Any]) -> list[Any]:
    chunks = list(chunks)
    if not chunks:
        raise ValueError("chunks must hold at least one micro-batch, got none")
    return chunks


def _flatten_all(trees: Sequence[Any], what: str) -> tuple[list[list[Any]], Any]:
    """Flatten each tree; all must share the first one's structure."""
    if len(trees) == 0:
        raise ValueError(f"{what} must hold at least one micro-batch's outputs, got none")
    flat, spec = [], None
    for j, tree in enumerate(trees):
        leaves, spec_j = pytree.tree_flatten(tree)
        if spec is None:
            spec = spec_j
        elif spec_j != spec:
            raise ValueError(f"{what}[{j}] has structure {spec_j}, but {what}[0] has {spec}")
        flat.append(leaves)
    if not flat[0]:
        raise ValueError(f"{what} hold no tensors")
    return flat, spec


def _cat_leaf(parts: list[Any], index: int) -> Tensor:
    for part in parts:
        if not isinstance(part, Tensor) or part.dim() == 0:
            raise TypeError(f"output {index} must be a tensor with a batch dim to concatenate, got {_describe(part)}")
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a one-element tensor, got {_describe(loss)}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a tensor that does not require grad")


def _storage_key(tensor: Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. sparse)
        return id(tensor)


def _storage_bytes(tensor: Tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


def _describe(obj: Any) -> str:
    if isinstance(obj, Tensor):
        return f"tensor of shape {tuple(obj.shape)} ({obj.dtype})"
    return type(obj).__name__
