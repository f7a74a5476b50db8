"""Which parameters an optimizer trains, and the buffers and hooks each one gets.

A param group's trainable parameters get flat groups (one per device and dtype: their fp32
buffers, fused_accum.flat) and, once the optimizer is built, hooks; a parameter frozen when its
group was added gets nothing until it is unfrozen (gradual unfreezing needs no
``add_param_group``), and then joins at the next step. A group's ``params`` list is fixed when
the group is added: a later edit of the list is refused at the next step, naming
``add_param_group``.
"""

from __future__ import annotations

import torch

from . import backends, checkpoint, masters
from .registry import initial_states, validate_hyperparameters
from .flat import SUPPORTED_DTYPES, FlatGroup


def _param_label(group_index, j, param, names):
    if names is not None:
        return repr(names[j])
    return f"param_groups[{group_index}]['params'][{j}] (shape {tuple(param.shape)}, {param.dtype})"


class Members:
    """The optimizer's parameters by group: which have buffers, which wait frozen."""

    def __init__(self, window, *, algorithm, generic, master_weights: bool, backend: str, bucket_cap_mb) -> None:
        self.window = window
        self.algorithm = algorithm  # a fused algorithm's name, or None (the generic path)
        self.generic = generic  # the generic path (fused_accum.generic), or None
        self.master_weights = master_weights
        self.backend_request = backend
        self.bucket_cap_mb = bucket_cap_mb
        self.attached = False  # the optimizer is built: new slots get hooks at once
        self.frozen: list = []  # (param, group index, label): no buffers until unfrozen
        self.group_ids: list = []  # by group: ids of its params as added (see check_unchanged)

    def add_group(self, param_groups: list, group_index: int, state: dict) -> None:
        """Buffers for the trainable parameters of ``param_groups[group_index]`` (just added);
        ``state``: ``opt.state`` (the generic path shows its optimizer's state there)."""
        group = param_groups[group_index]
        if self.algorithm is not None:
            validate_hyperparameters(self.algorithm, group)
        names = group.get("param_names")
        for j, p in enumerate(group["params"]):  # frozen ones too (unfrozen later), before anything is built
            masters.choose(self.master_weights, p.dtype, _param_label(group_index, j, p, names))  # (raises)
        seen, trainable = set(), []
        for j, p in enumerate(group["params"]):
            if id(p) in seen:  # torch warned about the duplicate; it is trained once
                continue
            seen.add(id(p))
            label = _param_label(group_index, j, p, names)
            if p.requires_grad:
                trainable.append((p, label))
            else:  # any dtype: an integer counter kept in a group is never trained
                self.frozen.append((p, group_index, label))
        self._make_flat_groups(group, group_index, trainable, state)
        self.group_ids.append(list(map(id, group["params"])))

    def _make_flat_groups(self, group: dict, group_index: int, members: list, state: dict) -> list:
        """Buffers for ``members`` ((param, label) pairs of one param group), one flat group per
        (device, dtype); hooks too once the optimizer is built. Returns the new slots."""
        by_key: dict = {}
        for p, label in members:
            if p.is_complex() or not p.is_floating_point() or p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"parameter {label} has dtype {p.dtype}; supported: float32, bfloat16, float16")
            by_key.setdefault((p.device, p.dtype), []).append((p, label))
        resolved = {
            key: backends.resolve(self.backend_request, key[0]) for key in by_key
        }  # may raise: before any buffer
        window, new_slots = self.window, []
        for (device, dtype), pairs in by_key.items():
            layout = self._layout(device, [p for p, _ in pairs])
            flat = FlatGroup(
                len(window.flat_groups),
                group_index,
                [p for p, _ in pairs],
                [l for _, l in pairs],
                len(window.slots),
                dtype,
                device,
                initial_states(self.algorithm, group),
                self.master_weights,
                resolved[(device, dtype)],
                self._bucket_numel(device),
                layout,
            )
            window.add(flat)
            new_slots.extend(flat.slots)
        window.topology.check_optimizer(window.ledger, self.generic.cls.__name__ if self.generic else None)
        if self.generic is not None:
            self.generic.add(group, group_index, new_slots, state)
        if self.attached:
            window.attach(new_slots)
        return new_slots

    def _layout(self, device, params: list):
        """The layout of a new flat group of ``params``: the placement's over the topology's,
        which the parameters may change as they join (DTensors are FSDP2's)."""
        window = self.window
        window.topology = window.topology.join(window.ledger, params)
        return window.placement.layout(device, window.topology.layout())

    def _bucket_numel(self, device: torch.device) -> int:
        """Elements per bucket for parameters on ``device`` (see ``bucket_cap_mb``)."""
        cap = self.bucket_cap_mb
        if cap is None:
            cap = self.window.topology.default_bucket_mb(device)
        return max(1, int(cap * 2**20 / 4))

    def adopt_unfrozen(self, opt) -> None:
        """Give buffers and hooks to parameters frozen when added and trainable now (gradual
        unfreezing). Their first window was accumulated natively in ``.grad``: taken as a
        gradient the user assigned (this rank's: a data-parallel topology reduces it with the
        window; FSDP2's is a DTensor, taken by its local shard), once; a checkpoint loaded while
        they were frozen gives them its state."""
        ready = [entry for entry in self.frozen if entry[0].requires_grad]
        if not ready:
            return
        self.frozen = [entry for entry in self.frozen if not entry[0].requires_grad]
        by_group: dict = {}
        for p, group_index, label in ready:
            by_group.setdefault(group_index, []).append((p, label))
        window, taken = self.window, []
        for group_index, members in by_group.items():
            for slot in self._make_flat_groups(opt.param_groups[group_index], group_index, members, opt.state):
                checkpoint.adopt_saved(opt, slot)
                if slot.param.grad is not None:
                    taken.append((slot, window.flat_groups[slot.flat_index].user_grad(slot, slot.param.grad)))
        if taken:
            window.take_user_grads(taken)
            if not window.topology.stands_aside:
                # .grad shows what the window holds now (else the step would take the native
                # .grad a second time: added twice where the topology stages it, shard="grads")
                for slot, _ in taken:
                    slot.param.grad = slot.grad_view

    def unfrozen(self) -> bool:
        """Whether a parameter frozen when added is trainable now (the eager step adopts it)."""
        return any(entry[0].requires_grad for entry in self.frozen)

    def check_none_unfrozen(self, owner: str) -> None:
        """Raise if a parameter frozen when added is trainable now: a compiled step cannot give
        it buffers (fused_accum.compiled traces such a step eagerly; this is the books' check)."""
        if self.unfrozen():
            raise RuntimeError(
                f"{owner}: a parameter frozen when its group was added is trainable now, and a compiled "
                "step cannot give it buffers: run this window's step() outside the compiled function once"
            )

    def check_unchanged(self, param_groups: list, owner: str) -> None:
        """Raise if a group's ``params`` list was edited (torch's optimizers walk the lists at
        every step; here each parameter's buffers and hooks were made when its group was added),
        or if the parameters were left on the meta device."""
        if len(param_groups) != len(self.group_ids) or any(
            list(map(id, g["params"])) != ids for g, ids in zip(param_groups, self.group_ids)
        ):
            raise RuntimeError(
                f"{owner}: the parameters of a param group changed since it was added "
                "(a parameter appended to or removed from group['params']); fused_accum gives each "
                "parameter its buffers and hooks when its group is added: use add_param_group() for "
                "new parameters, or build a new optimizer"
            )
        for flat in self.window.flat_groups:
            if flat.device.type == "meta" and flat.slots[0].param.is_meta:
                raise RuntimeError(
                    f"{owner}: its parameters are on the meta device. model.to_empty() makes new "
                    "parameters, which an optimizer built before cannot follow (their gradients "
                    "never reach it): build the optimizer after to_empty()"
                )
