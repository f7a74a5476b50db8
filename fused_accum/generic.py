"""The generic path: ``optimizer=`` any ``torch.optim.Optimizer`` class (e.g. RMSprop).

Gradients still accumulate in the fp32 buffers; at the step an inner optimizer of that class
steps the fp32 masters (a low-precision parameter's master, wrapped as a Parameter; an fp32
parameter itself) from the accumulated gradients, and the rounded result is written back. It is
not a topology, only another way to take the step: it syncs the host once to skip a step (torch
optimizers cannot skip on the device) and keeps the inner optimizer's state as ``opt.state``.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch


class GenericPath:
    """The inner ``torch.optim`` optimizer and what it steps for each of our parameters."""

    def __init__(self, cls: type, hyperparameters: dict) -> None:
        self.cls = cls
        # The keywords the optimizer was given, which the inner optimizer's constructor takes
        # as torch's would: some classes build their state from them and not from the groups
        # (Adagrad's initial_accumulator_value: its sum starts there, at construction and for
        # each parameter added later, from its defaults).
        self.hyperparameters = dict(hyperparameters)
        self.inner: Optional[torch.optim.Optimizer] = None  # built with the first group
        self.targets: dict = {}  # id(param) -> what the inner optimizer steps for it

    def add(self, group: dict, group_index: int, slots: list, state: dict) -> None:
        """Give the inner optimizer the new ``slots`` of param group ``group_index``; ``state``
        (``opt.state``) shows the state its constructor built for them (Adagrad's sum), as
        torch's optimizer shows it before a step."""
        inner_params = []
        for slot in slots:
            target = self._target(slot)
            self.targets[id(slot.param)] = target
            inner_params.append(target)
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        try:
            if self.inner is None:
                self.inner = self.cls([dict(params=inner_params, **hyper)], **self.hyperparameters)
                self.inner._fused_accum_inner = True  # ours: its steps take nothing over (window.py)
            elif len(self.inner.param_groups) > group_index:  # an unfrozen parameter joins its group
                self.inner.param_groups[group_index]["params"].extend(inner_params)
            else:
                self.inner.add_param_group(dict(params=inner_params, **hyper))
        except TypeError as err:
            raise TypeError(f"{self.cls.__name__} rejected param_groups[{group_index}]: {err}") from err
        for key, value in self.inner.param_groups[group_index].items():  # the class's defaults, as
            group.setdefault(key, value)  # torch's group shows them (and its load_state_dict reads them)
        for slot in slots:
            if self.targets[id(slot.param)] in self.inner.state:
                state[slot.param] = self.inner.state[self.targets[id(slot.param)]]

    def _target(self, slot):
        p = slot.param
        return p if slot.master is None else torch.nn.Parameter(slot.master.view(p.shape))

    def retarget(self, flat, state: dict) -> None:
        """``flat`` was moved or cast after its parameters (Stepper.rehome): the inner optimizer
        steps the new masters (or the parameters themselves), with its state moved along (fp32
        where there is a master, else the parameter's dtype)."""
        for slot in flat.slots:
            old, new = self.targets[id(slot.param)], self._target(slot)
            if new is old:
                continue
            self.targets[id(slot.param)] = new
            for group in self.inner.param_groups:
                group["params"] = [new if q is old else q for q in group["params"]]
            if old in self.inner.state:
                moved = {
                    k: v.to(new.device, new.dtype)
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0
                    else v
                    for k, v in self.inner.state.pop(old).items()
                }
                self.inner.state[new] = moved
                state[slot.param] = moved

    def load(self, param, state: dict) -> dict:
        """The inner optimizer's state for ``param`` from a checkpoint's entry; returns it (what
        ``opt.state[param]`` shows)."""
        target = self.targets[id(param)]
        self.inner.state[target] = {
            k: (v.detach().to(target.device).clone() if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
            for k, v in state.items()
        }
        return self.inner.state[target]

    def first_state(self, param, group: dict) -> dict:
        """The state the inner optimizer's first step sets up for ``param`` before it updates
        anything, or {} where no state loaded before a step makes that step: for a checkpoint
        entry that must exist for a parameter not stepped yet (it holds ``accum``), as torch's
        optimizers read the ``step`` of every entry they load (torch writes none before a
        step). ``group``: the param's group (ours, which the inner group mirrors at each step).

        Found on a probe, an optimizer of the class over a copy of what the inner one steps,
        whose state entry keeps a copy of the first value each key is given, stepped once from
        a gradient of ones; kept only if a second probe loaded with it takes the same step, bit
        for bit. Not SGD's: its momentum buffer is first set after the update (to the first
        gradient), so what the probe records there is a state after a step, not one to start
        from (an SGD entry needs none: its step reads no ``step``)."""
        target = self.targets[id(param)]
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        grad = torch.ones_like(target.detach())  # (not zeros: a zero step hides what a state changes)

        def probe(entry):
            weight = torch.nn.Parameter(target.detach().clone())
            weight.grad = grad
            optimizer = self.cls([dict(params=[weight], **hyper)], **self.hyperparameters)
            optimizer._fused_accum_inner = True  # (ours: its step takes nothing over, as the inner's)
            optimizer.state[weight] = entry(optimizer.state.get(weight, {}))  # (Adagrad builds one)
            optimizer.step()
            return weight, optimizer.state[weight]

        weight, recorded = probe(_FirstValues)
        first = recorded.first
        again, state = probe(lambda built: {k: _copy(v) for k, v in first.items()})
        same = torch.equal(weight, again) and recorded.keys() == state.keys()
        same = same and all(_equal(recorded[k], state[k]) for k in state)
        return first if same else {}

    def step(self, param_groups: list, slots: list, state: dict, scale: dict, skip) -> None:
        """One inner step from the accumulated gradients times ``scale`` (per device), unless
        ``skip`` (per device) says so; ``state`` (``opt.state``) then shows the inner state."""
        if skip is not None and any(bool(f.item()) for f in skip.values()):
            return  # torch optimizers cannot skip on the device: this path syncs once
        for group, inner_group in zip(param_groups, self.inner.param_groups):
            for key, value in group.items():  # schedulers write our groups; mirror them
                if key not in ("params", "param_names"):
                    inner_group[key] = value
        saved_grads = {}
        for slot in slots:
            p, target = slot.param, self.targets[id(slot.param)]
            saved_grads[slot.key] = p.grad
            if not slot.has_grad:
                target.grad = None
                continue
            # Scaled into a copy: the exposed .grad keeps the sum, as torch leaves .grad alone.
            grad = slot.grad_view * scale[slot.acc.device]
            # torch optimizers want .grad in the param's dtype: a bf16 param without a master
            # gets the fp32 sum rounded once, at the end of the window.
            target.grad = grad if target.dtype == torch.float32 else grad.to(target.dtype)
        self.inner.step()
        for slot in slots:
            p, target = slot.param, self.targets[id(slot.param)]
            if target is not p:
                target.grad = None
                if slot.has_grad:
                    p.detach().copy_(target.detach())
            p.grad = saved_grads[slot.key]
            if target in self.inner.state:
                state[p] = self.inner.state[target]


class _FirstValues(dict):
    """An optimizer state entry that keeps a copy of the first value each key is given (the
    state a first step sets up, before its update writes the values in place)."""

    def __init__(self, built: dict) -> None:
        super().__init__()
        self.first = {}
        for key, value in built.items():
            self[key] = value

    def __setitem__(self, key, value) -> None:
        if key not in self.first:
            self.first[key] = _copy(value)
        super().__setitem__(key, value)


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
