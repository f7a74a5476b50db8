"""Which live gradient window owns a parameter: the newest optimizer over a parameter wins.

A window claims its parameters when its optimizer is built (``claim``): a window that owned any
of them is detached first, so two optimizers never fold the same gradient. A torch.optim
optimizer (or any other) is seen only at its first step, through torch's global step pre-hook
(torch.optim has no hook at construction): if it steps parameters a live window owns, that
window hands them over (``GradientWindow.hand_over``: the accumulated gradients in ``.grad``, in
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


def is_ours(optimizer, depth: int = 4) -> bool:
    """Whether ``optimizer`` is a fused_accum optimizer, or a trainer's wrapper around one
    (Accelerate's AcceleratedOptimizer and its kind keep the wrapped one in ``.optimizer``)."""
    for _ in range(depth):
        if optimizer is None:
            return False
        # (the second: the torch.optim optimizer that fused_accum's generic path steps with)
        if getattr(optimizer, "_fused_accum_owner", False) or getattr(optimizer, "_fused_accum_inner", False):
            return True
        optimizer = getattr(optimizer, "optimizer", None)
    return False


def _foreign_step(optimizer, args, kwargs) -> None:
    """Before any torch.optim optimizer steps: one that is not ours, over parameters a live
    window owns, takes them over. The window hands it the accumulated gradients as ``.grad`` in
    the parameters' own dtype, which torch's kernels require, and stands aside."""
    if not _OWNERS or is_ours(optimizer):
        return
    windows = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            window = owner(p)
            if window is not None:
                windows[id(window)] = window
    for window in windows.values():
        window.hand_over(f"{type(optimizer).__name__} at {id(optimizer):#x} stepped its parameters")
