"""End to end: a small GPT-style model in bf16, k micro-batches per optimizer step (a window).

Three ways to train the same model on the same data from the same initial weights:

  fused_accum   ``fused_accum.FusedAccumOptimizer(..., "adamw", accum_steps=k)``: gradients
                folded into fp32 buffers as backward produces them, one fused AdamW step that
                updates the fp32 master and writes the bf16 params.
  torch_native  PyTorch's best equivalent: bf16 params with ``grad_dtype = torch.float32`` so
                autograd accumulates ``.grad`` in fp32 (torch >= 2.10; older torch: a
                post-accumulate-grad hook adds into an fp32 .grad of the master), fp32 master
                copies stepped by ``AdamW(fused=True)`` (``foreach=True`` where fused cannot
                run), then copied back into the bf16 params; ``.grad = None`` between windows.
  naive_bf16    plain bf16 ``.grad`` accumulation and ``AdamW(fused=True)`` on the bf16 params:
                what a script does when nobody thought about precision.

Each reports the median time per window (k forward+backward passes and the step), tokens/s,
peak device memory (CUDA only: the CPU allocator keeps no statistics), the memory still held
after the last step (weights, gradients, optimizer state), and the mean loss of the first and
last windows. The loss is the mean over each micro-batch, divided by k before backward, so all
three take the same mean-gradient step.

The data is a fixed random first-order Markov chain over the vocabulary (each token has 4
possible successors), so the loss can fall well below log(vocab) and a precision problem
shows up as a higher final loss.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks import common
from fused_accum import backends

VARIANTS = ("fused_accum", "torch_native", "naive_bf16")


@dataclass(frozen=True)
class E2EConfig:
    vocab: int = 8192
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    seq_len: int = 512
    micro_batch: int = 8
    accum_steps: int = 8  # micro-batches per window
    windows: int = 12  # optimizer steps, including the warm-up ones
    warmup_windows: int = 2  # not timed (allocator growth, kernel selection, compilation)
    lr: float = 1e-3
    weight_decay: float = 0.01
    branch: int = 4  # successors per token in the Markov chain
    seed: int = 0


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-2's layout (pre-norm blocks, learned positions, tied embedding and head)."""

    def __init__(self, cfg: E2EConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def make_batches(cfg: E2EConfig, device: torch.device) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """windows x accum_steps micro-batches of (inputs, targets) from the Markov chain, drawn on
    the CPU from ``cfg.seed`` so every variant and every machine trains on the same tokens."""
    gen = torch.Generator().manual_seed(cfg.seed)
    successors = torch.randint(cfg.vocab, (cfg.vocab, cfg.branch), generator=gen)
    probs = torch.rand(cfg.vocab, cfg.branch, generator=gen) + 0.1
    n_seq = cfg.windows * cfg.accum_steps * cfg.micro_batch
    tokens = torch.empty(n_seq, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab, (n_seq,), generator=gen)
    for t in range(cfg.seq_len):
        cur = tokens[:, t]
        choice = torch.multinomial(probs[cur], 1, generator=gen).squeeze(1)
        tokens[:, t + 1] = successors[cur, choice]
    tokens = tokens.view(cfg.windows, cfg.accum_steps, cfg.micro_batch, cfg.seq_len + 1).to(device)
    return [[(mb[:, :-1], mb[:, 1:]) for mb in window] for window in tokens]


def best_adamw_flag(device: torch.device) -> str:
    """'fused' where torch's fused AdamW runs on this device, else 'foreach'."""
    try:
        probe = torch.zeros(1, device=device, requires_grad=True)
        probe.grad = torch.ones_like(probe)
        torch.optim.AdamW([probe], fused=True).step()
        return "fused"
    except (RuntimeError, TypeError):
        return "foreach"


def _setup(variant: str, model: nn.Module, cfg: E2EConfig, device: torch.device) -> Tuple[Callable[[], None], str]:
    """Build the optimizer for ``variant``; return (end-of-window step, a note on how)."""
    hp = dict(lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=cfg.weight_decay)
    params = list(model.parameters())
    if variant == "fused_accum":
        from fused_accum import FusedAccumOptimizer

        opt = FusedAccumOptimizer(params, "adamw", accum_steps=cfg.accum_steps, **hp)

        def step():
            opt.step()
            opt.zero_grad()

        # What the optimizer's backend="auto" resolves to (FUSED_ACCUM_BACKEND included).
        return step, f"backend={backends.resolve('auto', device)}"
    flag = best_adamw_flag(device)
    if variant == "naive_bf16":
        opt = torch.optim.AdamW(params, **hp, **{flag: True})

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, f"AdamW({flag}=True) on bf16 params"
    if variant != "torch_native":
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return fp32_master_adamw(params, hp, flag)


def fp32_master_adamw(params, hp: Dict, flag: str = "fused") -> Tuple[Callable[[], None], str]:
    """PyTorch's best bf16 training step with fp32 accumulation (the torch_native variant, and
    benchmarks/window.py's native_fp32acc): autograd accumulates fp32 ``.grad`` of the bf16
    ``params``, ``torch.optim.AdamW(**hp, <flag>=True)`` steps fp32 master copies, which are
    then copied into the params; ``.grad`` is dropped between windows. Returns (end-of-window
    step, a note on how)."""
    masters = [p.detach().float() for p in params]
    if hasattr(torch.Tensor, "grad_dtype"):
        for p in params:
            p.grad_dtype = torch.float32  # autograd casts each incoming bf16 grad and adds in fp32
        how = "grad_dtype=float32"

        def gather_grads():
            for m, p in zip(masters, params):
                m.grad, p.grad = p.grad, None
    else:

        def fold(p, m):
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

        for p, m in zip(params, masters):
            p.register_post_accumulate_grad_hook(lambda p, m=m: fold(p, m))
        how = "post-accumulate-grad hook into fp32"
        gather_grads = lambda: None
    opt = torch.optim.AdamW(masters, **hp, **{flag: True})

    def step():
        gather_grads()
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        opt.zero_grad(set_to_none=True)

    return step, f"{how}; fp32 master AdamW({flag}=True); copy to bf16"


def run_variant(variant: str, cfg: E2EConfig, batches, device: torch.device) -> Dict:
    """Train a freshly initialised model for ``cfg.windows`` windows; one result row."""
    row: Dict = {"variant": variant}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(cfg.seed)  # the same initial weights for every variant
    model = TinyGPT(cfg).to(device=device, dtype=torch.bfloat16)
    row["n_params"] = sum(p.numel() for p in model.parameters())
    try:
        step, row["note"] = _setup(variant, model, cfg, device)
    except Exception as exc:  # noqa: BLE001 - e.g. the optimizer is not importable yet
        row.update(window_ms=math.nan, note=f"{type(exc).__name__}: {exc}"[:300])
        return row
    window_ms, window_loss = [], []
    for window in batches:
        common.synchronize(device)
        t0 = time.perf_counter()
        losses = []
        for inputs, targets in window:
            loss = model(inputs, targets)
            (loss / cfg.accum_steps).backward()
            losses.append(loss.detach())
        step()
        common.synchronize(device)
        window_ms.append((time.perf_counter() - t0) * 1e3)
        window_loss.append(torch.stack(losses).float().mean().item())
    timed = window_ms[cfg.warmup_windows :]
    median = statistics.median(timed)
    tokens = cfg.accum_steps * cfg.micro_batch * cfg.seq_len
    row.update(
        window_ms=median,
        window_ms_min=min(timed),
        window_ms_max=max(timed),
        spread_pct=100.0 * (max(timed) - min(timed)) / median,
        timed_windows=len(timed),
        tokens_per_s=tokens / (median * 1e-3),
        first_loss=window_loss[0],
        final_loss=window_loss[-1],
    )
    if device.type == "cuda":
        row["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        row["end_mem_mb"] = torch.cuda.memory_allocated(device) / 2**20
    else:
        row["peak_mem_mb"] = row["end_mem_mb"] = math.nan
    del model, step
    return row


def run(
    cfg: E2EConfig, device: torch.device, variants=VARIANTS, progress: Callable[[Dict], None] = lambda r: None
) -> List[Dict]:
    batches = make_batches(cfg, device)
    rows = []
    for variant in variants:
        row = run_variant(variant, cfg, batches, device)
        row["config"] = ",".join(f"{k}={v}" for k, v in asdict(cfg).items())
        rows.append(row)
        progress(row)
    native = next((r["window_ms"] for r in rows if r["variant"] == "torch_native"), math.nan)
    for r in rows:
        r["speedup_vs_native"] = native / r["window_ms"] if math.isfinite(r["window_ms"]) else math.nan
    return rows


def format_row(r: Dict) -> str:
    if not math.isfinite(r.get("window_ms", math.nan)):
        return f"e2e {r['variant']:<13} FAILED {r.get('note', '')}"
    mem = f"{r['peak_mem_mb']:8.1f} MB peak" if math.isfinite(r["peak_mem_mb"]) else "   (no peak mem on CPU)"
    speed = r.get("speedup_vs_native", math.nan)
    speed_txt = f"{speed:5.2f}x" if math.isfinite(speed) else "    -"
    return (
        f"e2e {r['variant']:<13} {r['window_ms']:9.2f} ms/window ±{r['spread_pct']:.0f}%  {speed_txt}  "
        f"{r['tokens_per_s']:10.0f} tok/s  {mem}  loss {r['first_loss']:.3f} -> {r['final_loss']:.3f}"
    )
