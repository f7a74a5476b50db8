"""Checkpoints: ``state_dict``, ``gathered_state_dict`` and ``load_state_dict`` of a
:class:`~fused_accum.FusedAccumOptimizer`, in torch's shape (what each holds:
docs/optimizer.md, "Checkpoints", and docs/distributed.md).

Each function takes the optimizer for the call and keeps nothing of it. A saved entry holds
torch's state names plus ``master`` (the fp32 copy of a low-precision parameter) and, mid-window,
``accum`` (the accumulated gradient); each param group records ``window_microbatches``, so a
checkpoint taken mid-window resumes exactly. What a mode saves and loads otherwise is its own:
the topology's ``saved_value`` and ``gather_full`` (a rank's pieces, as rows of DTensors) and the
flat group's layout (what of a loaded value this process holds, whether ``accum`` is saved).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import ALGORITHMS, initial_states
from .flat import Slot
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


def state_dict(opt) -> dict:
    """``opt.state_dict()``: torch's ``{"state", "param_groups"}`` with per-parameter tensors
    only (copies); the four kinds of state-dict hooks run as in torch."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    window = opt._window
    window.flush()
    window.reconcile()
    window.placement.before_checkpoint(window.flat_groups)
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
        flat = window.flat_groups[slot.flat_index]
        keeps_master = flat.masters.keeps
        if not keeps_master and not slot.has_grad:
            continue
        saves_accum = slot.has_grad and flat.layout.saves_accum(slot)
        index = index_of[id(p)]
        if not state.get(index):  # (not stepped yet: torch keeps no entry, and loads none without its state)
            if opt._generic is not None and not saves_accum and _master_is_the_weight(flat, slot):
                continue  # (torch's form, no entry: at load the master is the weight's value)
            state.setdefault(index, {}).update(_first_state(opt, flat, slot))
        entry = state[index]
        if keeps_master:  # (as fp32, whatever the format keeps: fused_accum.masters)
            entry["master"] = flat.state_view(slot, flat.master_of(slot)).clone()
        if saves_accum:
            entry["accum"] = slot.grad_view.clone()
    for slot in window.slots:  # (a topology's own form: a rank's pieces as rows of DTensors)
        entry = state.get(index_of[id(slot.param)], {})
        for key, value in entry.items():
            if isinstance(value, Tensor):
                entry[key] = window.topology.saved_value(window.flat_groups[slot.flat_index], slot, key, value)
    result = {"state": state, "param_groups": groups}
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        returned = post_hook(opt, result)
        if returned is not None:
            result = returned
    return result


def _first_state(opt, flat, slot: Slot) -> dict:
    """The state a parameter that has not stepped yet starts its first step from, as torch
    would hold it: for the algorithms whose torch state counts steps (Adam, AdamW), a step count
    of 0 and each buffer at its record's initial value, so that an entry that holds its
    ``master`` (or ``accum``) is one torch can load (its ``load_state_dict`` reads the ``step``
    of every entry) and steps from as from none. None for the others: SGD's momentum starts
    from the first gradient, not from zeros. The generic path asks its torch.optim class
    (GenericPath.first_state); it writes no entry at all where the entry would hold only a
    master equal to the weight (state_dict), as torch writes none."""
    if opt._generic is not None:
        return opt._generic.first_state(slot.param, opt.param_groups[flat.group_index])
    algorithm = opt._stepper.algorithm
    if algorithm is None or not ALGORITHMS[algorithm].has_step:
        return {}
    template = next(iter(slot.state.values()))  # (every state buffer has the slot's layout)
    initial = initial_states(algorithm, opt.param_groups[flat.group_index])
    entry = {"step": torch.zeros_like(flat.steps[slot.index])}
    entry.update({key: flat.state_view(slot, torch.full_like(template, value)) for key, value in initial.items()})
    return entry


def _master_is_the_weight(flat, slot: Slot) -> bool:
    """Whether ``slot``'s master is its parameter's value widened to fp32 (or the group keeps no
    master): what a checkpoint without the master loads back to (load_state_dict)."""
    return not flat.masters.keeps or torch.equal(flat.master_of(slot), flat.param_piece(slot).float())


def gathered_state_dict(opt) -> dict:
    """``opt.gathered_state_dict()``: :func:`state_dict` with every per-parameter tensor whole,
    in torch's shape, all-gathered where a rank holds pieces (a collective then: call it on every
    rank); where this process holds them whole it is :func:`state_dict`."""
    result = state_dict(opt)
    window = opt._window
    index_of = _param_indices(opt.param_groups)
    for flat in window.flat_groups:  # the same flat groups and keys, in the same order, on every rank
        buffers = dict(sorted(flat.state.items()))
        master = flat.master_buffer()
        if master is not None:
            buffers["master"] = master
        for key, buf in buffers.items():
            full = window.topology.gather_full(flat, buf)
            if full is None:  # (held whole here)
                return result
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
    opt._members.adopt_unfrozen(opt)  # (unfrozen since the last step: they get slots, and their state, now)
    window.discard()
    for flat in window.flat_groups:  # a model loaded first: the masters it leaves unsaved follow it
        flat.refresh_masters()
    opt.state.clear()
    id_to_param = {}
    for group, saved_group in zip(opt.param_groups, saved_groups):
        for key, value in saved_group.items():
            if key not in ("params", "window_microbatches"):
                group[key] = value
        id_to_param.update(zip(saved_group["params"], group["params"]))
    window.ledger.resumed(int(saved_groups[0].get("window_microbatches", 0)) if saved_groups else 0)
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
    # (no master saved, a plain torch checkpoint's: the parameter's value is the master)
    flat.set_master(slot, fp32_piece(flat, slot, entry["master"]) if "master" in entry else None)
    if "accum" in entry:
        slot.acc.copy_(fp32_piece(flat, slot, entry["accum"]))
        opt._window.ledger.took_grad(slot)
    state = {k: v for k, v in entry.items() if k not in ("master", "accum")}
    if opt._generic is not None:
        opt.state[p] = opt._generic.load(p, state)
        return
    if state:
        opt._stepper.load_slot_state(flat, slot, state)
