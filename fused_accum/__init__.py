"""fused_accum: exact, fused gradient accumulation for PyTorch."""
