"""fused_accum: exact, fused gradient accumulation for PyTorch.

Micro-batch gradients (bf16/fp16/fp32) are folded into persistent fp32 buffers by multi-tensor
kernels as backward produces them, and the optimizer step reads those buffers once, updating
the fp32 master weights and writing the low-precision parameters in the same pass.

    opt = fused_accum.AdamW(model.parameters(), lr=3e-4, accum_steps=8)

See README.md for the two accumulation loops and the learning-rate question.
"""

from . import nn  # fused_accum.nn.Linear: weight gradients straight into the fp32 accumulators
from .optimizer import FusedAccumOptimizer

# (importing them registers the fused algorithms)
from .algorithms import SGD, Adagrad, Adam, AdamW, AdEMAMix, Lion
from .muon import Muon

__all__ = ["FusedAccumOptimizer", "SGD", "Adam", "AdamW", "Lion", "Adagrad", "AdEMAMix", "Muon", "nn"]
__version__ = "0.1.0"
