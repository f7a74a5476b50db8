"""Which live gradient window owns a parameter: the newest optimizer over a parameter wins.

A window claims its parameters when its optimizer is built (``claim``): a window that owned any
of them is detached first, so two optimizers never fold the same gradient. A torch.optim
optimizer (or any other) is seen only at its first step, through torch's global step pre-hook
(torch.optim has no hook at construction): if it steps parameters a live window owns, that
window hands them over (:func:`_hand_over`: the accumulated gradients in ``.grad``, in
the parameters' dtype) and stands aside.

Entries are keyed by ``id(param)`` (tensors compare element-wise, not by identity) and hold the
parameter and the window weakly: neither is kept alive here.
"""

from __future__ import annotations

import weakref
from torch import Tensor

# id(parameter) -> (weak parameter, weak window whose hooks take its gradients)
_OWNERS: dict = {}
_FOREIGN_STEP_HOOK = None  # torch.optim's global step pre-hook, registered at the first claim


def owner(param: Tensor):
    """The live window hooked to ``param``, or None."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def claim(window, params) -> None:
    """``window`` owns ``params`` from now on; windows that owned any of them are detached."""
    global _FOREIGN_STEP_HOOK
    if _FOREIGN_STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _FOREIGN_STEP_HOOK = register_optimizer_step_pre_hook(_foreign_step)
    older = {owner(p) for p in params} - {None, window}
    for other in older:
        other.detach(f"a newer optimizer took over its parameters ({window.label})")
    this = weakref.ref(window)
    for p in params:
        key = id(p)

        def forget(ref, key=key):  # the parameter died: drop its entry (unless reused since)
            if _OWNERS.get(key, (None,))[0] is ref:
                del _OWNERS[key]

        _OWNERS[key] = (weakref.ref(p, forget), this)


def release(window, params) -> None:
    """``window`` gives up those of ``params`` it still owns."""
    for p in params:
        if owner(p) is window:
            del _OWNERS[id(p)]


def _is_ours(optimizer) -> bool:
    # (the second: the torch.optim optimizer that fused_accum's generic path steps with)
    return getattr(optimizer, "_fused_accum_owner", False) or getattr(optimizer, "_fused_accum_inner", False)


def is_ours(optimizer, depth: int = 3) -> bool:
    """Whether ``optimizer`` is a fused_accum optimizer or holds one: a trainer's wrapper
    (Accelerate's AcceleratedOptimizer keeps it in ``.optimizer``, Lightning's in
    ``._optimizer``), an optimizer built over ours that delegates its step to it (SAM's
    ``base_optimizer``, ZeroRedundancyOptimizer's ``optim``), or one that shares our param
    groups (SAM's ``param_groups`` are its base's). Such a step ends in ours: it takes nothing
    over. Attributes are searched ``depth`` optimizers deep (an attribute's value, or the
    elements of a list, tuple or dict attribute)."""
    if optimizer is None:
        return False
    if _is_ours(optimizer):
        return True
    if depth == 0:
        return False
    try:
        held = list(vars(optimizer).values())
    except TypeError:  # (no __dict__)
        return False
    for value in held:
        candidates = (
            value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        )
        for candidate in candidates:
            if isinstance(candidate, (dict, list, tuple, str, int, float, type(None))) or not hasattr(
                candidate, "step"
            ):
                continue
            if is_ours(candidate, depth - 1):
                return True
    return _shares_our_groups(optimizer)


def _shares_our_groups(optimizer) -> bool:
    """Whether ``optimizer``'s param groups are a live fused_accum optimizer's own dicts."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return False
    first = groups[0]
    window = (
        next((owner(p) for p in first.get("params", ()) if owner(p) is not None), None)
        if isinstance(first, dict)
        else None
    )
    return window is not None and any(g is first for g in window.param_groups())


def _foreign_step(optimizer, args, kwargs) -> None:
    """Before any torch.optim optimizer steps: one that is not ours, over parameters a live
    window owns, takes them over. The window hands it the accumulated gradients as ``.grad`` in
    the parameters' own dtype, which torch's kernels require, and stands aside."""
    # (ours first: Dynamo, tracing a compiled step through this hook, then reads only our flag;
    # reading the table would guard the graph on every entry of it)
    if _is_ours(optimizer) or not _OWNERS or is_ours(optimizer):
        return
    windows = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            window = owner(p)
            if window is not None:
                windows[id(window)] = window
    for window in windows.values():
        _hand_over(window, f"{type(optimizer).__name__} at {id(optimizer):#x} stepped its parameters")


def _hand_over(window, reason: str) -> None:
    """``window`` detaches, leaving each accumulated gradient in ``.grad`` as autograd would have
    it (a tensor of the parameter's dtype), for the other optimizer to step."""
    with window.lock:
        window.flush()
        window.reconcile()
        for slot in window.slots:
            p = slot.param
            if slot.has_grad and p.grad is slot.grad_view and slot.grad_view is not slot.placeholder:
                p.grad = slot.grad_view.to(p.dtype, copy=True)
                window.ledger.cleared(slot)
        window.ledger.clear_table()
        window.detach(reason)
