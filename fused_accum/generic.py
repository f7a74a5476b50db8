"""The generic path: ``optimizer=`` any ``torch.optim.Optimizer`` class (e.g. RMSprop).

Gradients still accumulate in the fp32 buffers; at the step an inner optimizer of that class
steps the fp32 masters (a low-precision parameter's master, wrapped as a Parameter; an fp32
parameter itself) from the accumulated gradients, and the rounded result is written back. It is
not a topology, only another way to take the step: it syncs the host once to skip a step (torch
optimizers cannot skip on the device) and keeps the inner optimizer's state as ``opt.state``.
"""

from __future__ import annotations

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
