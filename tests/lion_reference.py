"""An independent plain-torch Lion, written from the paper (Chen et al. 2023, "Symbolic Discovery
of Optimization Algorithms", Algorithm 2): the oracle the tests hold fused_accum.Lion to."""

import torch


class LionReference(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = torch.sign(b1 * m + (1 - b1) * p.grad)  # the sign uses the old momentum
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
