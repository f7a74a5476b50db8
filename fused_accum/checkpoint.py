"""Checkpoints: ``state_dict``, ``gathered_state_dict`` and ``load_state_dict`` of a
:class:`~fused_accum.FusedAccumOptimizer`, in torch's shape (what each holds: the README's
"Checkpoints" and "Data parallel and sharding").

Each function takes the optimizer for the call and keeps nothing of it. A saved entry holds
torch's state names plus ``master`` (the fp32 copy of a low-precision parameter) and, mid-window,
``accum`` (the accumulated gradient); each param group records ``window_microbatches``, so a
checkpoint taken mid-window resumes exactly. Sharded optimizers (``shard=``) save each rank's
pieces as rows of DTensors and load either those or whole, torch-shaped values: the branches
for them test ``_sharded(window)``; the one for DTensor (FSDP2) parameters tests ``is_dtensor``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .flat import Slot, is_dtensor
from .step import fp32_piece


def _param_indices(param_groups: list) -> dict:
    """torch's numbering of the parameters: by position over the groups, a duplicate keeps its
    first. id(param) -> index."""
    index_of, start = {}, 0
    for group in param_groups:
        for i, p in enumerate(group["params"], start):
            index_of.setdefault(id(p), i)
        start += len(group["params"])
    return index_of


def _sharded(window) -> bool:
    return window.topology.sharded


def state_dict(opt) -> dict:
    """``opt.state_dict()``: torch's ``{"state", "param_groups"}`` with per-parameter tensors
    only (copies); the four kinds of state-dict hooks run as in torch."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    window = opt._window
    window.flush()
    window.reconcile()
    for flat in window.flat_groups:
        flat.refresh_masters()  # a checkpoint holds the weights the model has now
    index_of = _param_indices(opt.param_groups)
    groups = []
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [index_of[id(p)] for p in group["params"]]
        packed["window_microbatches"] = window.microbatches
        groups.append(packed)
    state = {}
    for key, entry in opt.state.items():
        if not isinstance(key, Tensor):  # put there by a hook or a subclass: kept as is, as torch does
            state[key] = entry
        elif id(key) in index_of:
            state[index_of[id(key)]] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.items()}
    for slot in window.slots:
        p = slot.param
        if slot.master is None and not slot.has_grad:
            continue
        entry = state.setdefault(index_of[id(p)], {})
        if slot.master is not None:
            entry["master"] = window.flat_groups[slot.flat_index].state_view(slot, slot.master).clone()
        # (sharded: the local sum. DTensor params: the window's gradient is the .grad FSDP2
        # adds into, which a checkpoint does not hold, as with torch.optim)
        if slot.has_grad and slot.grad_view is not slot.placeholder and not is_dtensor(p):
            entry["accum"] = slot.grad_view.clone()
    if _sharded(window):
        # each rank's pieces as rows of DTensors, so torch.distributed.checkpoint keeps them all
        for slot in window.slots:
            entry = state.get(index_of[id(slot.param)], {})
            for key, value in entry.items():
                if key != "accum" and isinstance(value, Tensor) and value.dim() == 1:
                    entry[key] = window.topology.state_rows(window.flat_groups[slot.flat_index], slot, value)
    result = {"state": state, "param_groups": groups}
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        returned = post_hook(opt, result)
        if returned is not None:
            result = returned
    return result


def gathered_state_dict(opt) -> dict:
    """``opt.gathered_state_dict()``: (sharded) :func:`state_dict` with every per-parameter
    tensor whole, in torch's shape, all-gathered from the ranks' pieces; a collective. Without
    sharding it is :func:`state_dict`."""
    result = state_dict(opt)
    window = opt._window
    if not _sharded(window):
        return result
    index_of = _param_indices(opt.param_groups)
    for flat in window.flat_groups:  # the same flat groups and keys, in the same order, on every rank
        buffers = dict(sorted(flat.state.items()))
        if flat.master is not None:
            buffers["master"] = flat.master
        for key, buf in buffers.items():
            full = window.topology.gather_full(flat, buf)
            for slot in flat.slots:
                entry = result["state"].get(index_of[id(slot.param)])
                if entry is not None and key in entry:
                    p = slot.param
                    entry[key] = full[slot.offset : slot.offset + p.numel()].view(p.shape).clone()
    return result


def load_state_dict(opt, saved: dict) -> None:
    """``opt.load_state_dict(saved)``: our own state dict, or a plain torch SGD/Adam/AdamW one
    (missing keys default), all in fp32. A value with the parameter's number of elements is cut
    to this rank's piece (sharded); any other is taken as this rank's piece."""
    saved = saved.copy()
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, saved)
        if result is not None:
            saved = result
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(opt.param_groups, saved_groups)):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        )
    window = opt._window
    opt._adopt_unfrozen()  # (unfrozen since the last step: they get slots, and their state, now)
    window.discard()
    opt.state.clear()
    id_to_param = {}
    for group, saved_group in zip(opt.param_groups, saved_groups):
        for key, value in saved_group.items():
            if key not in ("params", "window_microbatches"):
                group[key] = value
        id_to_param.update(zip(saved_group["params"], group["params"]))
    window.count.microbatches = int(saved_groups[0].get("window_microbatches", 0)) if saved_groups else 0
    saved_state = saved["state"]
    for pid, p in id_to_param.items():
        slot = window.slot_for(p)
        if slot is not None and pid in saved_state:
            _load_param_state(opt, slot, saved_state[pid])
        elif pid in saved_state:  # frozen now: kept in opt.state, as torch keeps it, and loaded
            opt.state[p] = dict(saved_state[pid])  # into its slot when it is unfrozen (adopt_saved)
    for key, value in saved_state.items():
        if key not in id_to_param:  # not a parameter's: kept as is, as torch does
            opt.state[key] = value
    for flat in window.flat_groups:
        flat.masters_written()  # the masters are the checkpoint's now
    window.expose()  # the gradients the checkpoint held show in .grad, as they did when saved
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def adopt_saved(opt, slot: Slot) -> None:
    """A parameter unfrozen after a checkpoint was loaded: the state the checkpoint held for it
    (kept in ``opt.state`` meanwhile, see load_state_dict) goes into its new slot."""
    entry = opt.state.get(slot.param)
    if entry:
        _load_param_state(opt, slot, dict(entry))


def _load_param_state(opt, slot: Slot, entry: dict) -> None:
    p = slot.param
    flat = opt._window.flat_groups[slot.flat_index]
    if slot.master is not None:
        slot.master.copy_(fp32_piece(flat, slot, entry["master"]) if "master" in entry else flat.param_piece(slot))
    if "accum" in entry:
        slot.acc.copy_(fp32_piece(flat, slot, entry["accum"]))
        slot.has_grad = True
    state = {k: v for k, v in entry.items() if k not in ("master", "accum")}
    if opt._generic is not None:
        opt.state[p] = opt._generic.load(p, state)
        return
    if state:
        opt._stepper.load_slot_state(flat, slot, state)
