"""``python -m fused_accum demo``: which accumulation loop, and which learning rate? Measured.

Two loops accumulate gradients over k micro-batches: (A) ``backward()`` on every micro-batch and
one ``step()`` every k, and (B) keep the k outputs, concatenate them, compute the loss once and
``backward()`` once. This demo runs both (and B's memory-bounded cached form, and A through
:class:`~fused_accum.FusedAccumOptimizer`) on synthetic data and small models, on the GPU when
there is one, else the CPU, and prints four tables built from what it measured:

1. one window, per-sample loss: gradient error against one large batch, saved activations, time;
2. micro-batches of unequal size (token counts): mean of per-micro-batch means vs ``num_items``;
3. a contrastive loss with in-batch negatives, where loop A is not the large batch;
4. training curves with SGD and AdamW: large batch, k micro-batches with and without dividing
   the loss by k (``--plot PATH`` draws them),

then answers both questions in plain words with the figures just measured. Default: 5-8 s on 2
busy CPU cores; ``--quick`` (smaller models, fewer steps): 2-4 s, used by the tests.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import textwrap
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .optimizer import FusedAccumOptimizer
from .stacked import SavedActivationMeter, cached_backward, split_batch, stacked_backward


@dataclasses.dataclass(frozen=True)
class Config:
    k: int = 4  # micro-batches per window
    batch: int = 256  # samples per window (tables 1 and 3)
    width: int = 256  # hidden width of the MLPs in tables 1 and 3
    reps: int = 10  # timed windows per row; the table shows the fastest
    tokens: tuple = (37, 250, 88, 141)  # table 2: tokens in each micro-batch
    steps: int = 100  # table 4: optimizer steps per training run
    lr_batch: int = 64  # table 4: samples per step
    seed: int = 0


DEFAULT = Config()
QUICK = Config(batch=64, width=64, reps=3, steps=15)
IN_DIM, CLASSES = 32, 10


# ---------------------------------------------------------------- measuring helpers


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def flat_grad(model: nn.Module, opt: FusedAccumOptimizer | None = None) -> torch.Tensor:
    grads = [p.grad if opt is None else opt.accumulated_grad(p) for p in model.parameters()]
    return torch.cat([g.flatten() for g in grads])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_window(
    window: Callable[[], None],
    reset: Callable[[], None],
    model: nn.Module,
    inputs: list[torch.Tensor],
    reps: int,
    device: torch.device,
) -> tuple[int, float]:
    """Peak saved-activation bytes of one window, and its best time over ``reps`` windows.

    Timed without the meter, whose hooks cost time. The best, not the median: on shared cores
    other processes only ever add time (medians moved 5x between runs here, minima far less).
    Parameters and the batch's inputs are alive whichever loop runs, so they are not counted:
    the figure is activations only.
    """
    reset()
    with SavedActivationMeter(exclude=[*model.parameters(), *inputs]) as meter:
        window()
    times = []
    for _ in range(reps):
        reset()
        sync(device)
        start = time.perf_counter()
        window()
        sync(device)
        times.append(time.perf_counter() - start)
    reset()
    window()  # leave this window's gradient for the caller to read
    return meter.peak, min(times)


def mlp(width: int, out: int = CLASSES, depth: int = 2) -> nn.Sequential:
    layers, d = [], IN_DIM
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.GELU()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, out))


def pair_ce(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits, labels = out
    return F.cross_entropy(logits, labels)


# ---------------------------------------------------------------- table 1: per-sample loss


def table_loops(cfg: Config, device: torch.device, bar: tqdm) -> dict:
    torch.manual_seed(cfg.seed)
    model = mlp(cfg.width).to(device)
    x = torch.randn(cfg.batch, IN_DIM, device=device)
    y = torch.randint(0, CLASSES, (cfg.batch,), device=device)
    chunks = split_batch((x, y), cfg.k)
    model_fn = lambda xc, yc: (model(xc), yc)  # noqa: E731 - labels ride along with the logits

    def loop_a(net: nn.Module, scale: float) -> Callable[[], None]:
        def window() -> None:
            for xc, yc in chunks:
                (F.cross_entropy(net(xc), yc) * scale).backward()

        return window

    plain_reset = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    fused_model = copy.deepcopy(model)  # the optimizer's hooks own this copy's gradients
    opt = FusedAccumOptimizer(fused_model.parameters(), "adamw", lr=1e-3, accum_steps=cfg.k)

    rows = {}
    cases = [
        ("large batch", lambda: pair_ce(model_fn(x, y)).backward(), None),
        ("A, loss not divided", loop_a(model, 1.0), None),
        ("A, loss / k", loop_a(model, 1.0 / cfg.k), None),
        ("A, FusedAccumOptimizer", loop_a(fused_model, 1.0 / cfg.k), opt),
        ("B, stacked", lambda: stacked_backward(model_fn, chunks, pair_ce), None),
        ("B, cached", lambda: cached_backward(model_fn, chunks, pair_ce), None),
    ]
    for label, window, fused in cases:
        net = model if fused is None else fused_model
        reset = plain_reset if fused is None else fused.zero_grad
        peak, seconds = measure_window(window, reset, net, [x, y], cfg.reps, device)
        rows[label] = dict(grad=flat_grad(net, fused), peak=peak, seconds=seconds)
        bar.update(1)
    ref = rows["large batch"]["grad"]
    for row in rows.values():
        row["err"] = rel_err(row.pop("grad"), ref)
    return rows


# ---------------------------------------------------------------- table 2: unequal micro-batches


def table_unequal(cfg: Config, device: torch.device, bar: tqdm) -> dict:
    """Token-level cross-entropy over micro-batches holding different numbers of tokens. Each
    run takes one SGD step with lr = 1 through FusedAccumOptimizer, so the parameter change is
    exactly the normalised gradient, and is compared with the large batch's step."""
    torch.manual_seed(cfg.seed + 1)
    model = mlp(64, out=50)
    total = sum(cfg.tokens)
    x = torch.randn(total, IN_DIM, device=device)
    y = torch.randint(0, 50, (total,), device=device)
    parts = list(zip(torch.split(x, list(cfg.tokens)), torch.split(y, list(cfg.tokens))))
    model.to(device)

    def one_step(accum_steps: int, window: Callable[[nn.Module], None], num_items=None):
        net = copy.deepcopy(model)
        before = torch.cat([p.detach().flatten() for p in net.parameters()])
        opt = FusedAccumOptimizer(net.parameters(), "sgd", lr=1.0, accum_steps=accum_steps)
        window(net)
        opt.step(num_items=num_items)
        bar.update(1)
        return before - torch.cat([p.detach().flatten() for p in net.parameters()])

    k = len(parts)
    large = one_step(1, lambda net: F.cross_entropy(net(x), y).backward())

    def mean_of_means(net: nn.Module) -> None:
        for xc, yc in parts:
            (F.cross_entropy(net(xc), yc) / k).backward()

    def summed(net: nn.Module) -> None:
        for xc, yc in parts:
            F.cross_entropy(net(xc), yc, reduction="sum").backward()

    return {
        "tokens": cfg.tokens,
        "mean of means": rel_err(one_step(k, mean_of_means), large),
        "num_items": rel_err(one_step(k, summed, num_items=total), large),
        # An item of a micro-batch of n tokens weighs 1 / (k n) in the mean of means.
        "weight ratio": max(cfg.tokens) / min(cfg.tokens),
    }


# ---------------------------------------------------------------- table 3: contrastive loss


def info_nce(out: tuple[torch.Tensor, torch.Tensor], tau: float = 0.1) -> torch.Tensor:
    """Query i's positive is document i; every other document in the batch is a negative."""
    q, d = out
    logits = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T / tau
    return F.cross_entropy(logits, torch.arange(len(q), device=q.device))


class DualEncoder(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.d = mlp(width, out=32), mlp(width, out=32)

    def forward(self, queries: torch.Tensor, docs: torch.Tensor):
        return self.q(queries), self.d(docs)


def table_contrastive(cfg: Config, device: torch.device, bar: tqdm) -> dict:
    torch.manual_seed(cfg.seed + 2)
    model = DualEncoder(cfg.width).to(device)
    queries = torch.randn(cfg.batch, IN_DIM, device=device)
    docs = queries + 0.5 * torch.randn_like(queries)  # positives resemble their query
    chunks = split_batch((queries, docs), cfg.k)

    def large_batch() -> float:
        return float(_backward(info_nce(model(queries, docs))))

    def loop_a() -> float:  # normalised, but each chunk only sees its own negatives
        return sum(float(_backward(info_nce(model(*chunk)) / cfg.k)) for chunk in chunks)

    def stacked() -> float:
        return float(stacked_backward(model, chunks, info_nce))

    def cached() -> float:
        return float(cached_backward(model, chunks, info_nce))

    cases = [
        ("large batch", large_batch, cfg.batch - 1),
        ("A, loss / k", loop_a, cfg.batch // cfg.k - 1),
        ("B, stacked", stacked, cfg.batch - 1),
        ("B, cached", cached, cfg.batch - 1),
    ]
    rows = {}
    for label, run, negatives in cases:
        losses = []
        reset = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
        window = lambda: losses.append(run())  # noqa: E731
        peak, seconds = measure_window(window, reset, model, [queries, docs], cfg.reps, device)
        rows[label] = dict(grad=flat_grad(model), peak=peak, seconds=seconds, negatives=negatives, loss=losses[-1])
        bar.update(1)
    ref = rows["large batch"]["grad"]
    for row in rows.values():
        row["err"] = rel_err(row.pop("grad"), ref)
    return rows


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


# ---------------------------------------------------------------- table 4: learning rate


def table_lr(cfg: Config, device: torch.device, bar: tqdm) -> dict:
    """Train the same model from the same start on the same windows: one large batch per step,
    or k micro-batches accumulated with and without dividing the loss by k."""
    torch.manual_seed(cfg.seed + 3)
    teacher = mlp(32).to(device)
    x_all = torch.randn(cfg.steps * cfg.lr_batch, IN_DIM, device=device)
    with torch.no_grad():  # learnable labels: a teacher network's argmax, 10 classes
        y_all = teacher(x_all).argmax(-1)
    x_eval = torch.randn(512, IN_DIM, device=device)
    with torch.no_grad():
        y_eval = teacher(x_eval).argmax(-1)
    start = mlp(32).to(device)

    runs = {
        # SGD lr 0.2 (momentum 0.9) had the lowest final eval loss of 0.05, 0.1, 0.2, 0.3 and
        # 0.5 here (measured, 60 steps): the right lr for this large batch, which k x overshoots.
        "SGD": (
            "sgd",
            dict(lr=0.2, momentum=0.9),
            [
                ("large batch", 1, 1.0, 1.0),
                ("k, loss not divided", cfg.k, 1.0, 1.0),
                ("k, loss / k", cfg.k, 1.0 / cfg.k, 1.0),
                ("k, loss / k, lr x k", cfg.k, 1.0 / cfg.k, float(cfg.k)),
            ],
        ),
        "AdamW": (
            "adamw",
            dict(lr=3e-3, weight_decay=0.01),
            [
                ("large batch", 1, 1.0, 1.0),
                ("k, loss not divided", cfg.k, 1.0, 1.0),
                ("k, loss / k", cfg.k, 1.0 / cfg.k, 1.0),
            ],
        ),
    }
    results = {}
    for opt_label, (algo, hyper, variants) in runs.items():
        for label, chunks_per_step, scale, lr_mult in variants:
            net = copy.deepcopy(start)
            opt = FusedAccumOptimizer(
                net.parameters(), algo, accum_steps=chunks_per_step, **{**hyper, "lr": hyper["lr"] * lr_mult}
            )
            curve = []
            for step in range(cfg.steps):
                window = slice(step * cfg.lr_batch, (step + 1) * cfg.lr_batch)
                for xc, yc in split_batch((x_all[window], y_all[window]), chunks_per_step):
                    (F.cross_entropy(net(xc), yc) * scale).backward()
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    curve.append(F.cross_entropy(net(x_eval), y_eval).item())
            params = torch.cat([p.detach().flatten() for p in net.parameters()])
            results[(opt_label, label)] = dict(curve=curve, params=params, lr=hyper["lr"] * lr_mult)
            bar.update(1)
    theta0 = torch.cat([p.detach().flatten() for p in start.parameters()])

    def drift(params: torch.Tensor, ref: torch.Tensor) -> float:
        """Distance from the reference run, relative to how far that run travelled: 0 is the
        same trajectory, about 1 or more another one."""
        return ((params - ref).norm() / (ref - theta0).norm()).item()

    for (opt_label, label), run in results.items():
        run["drift"] = drift(run["params"], results[(opt_label, "large batch")]["params"])
    undivided = results[("SGD", "k, loss not divided")]["params"]
    lr_x_k = results[("SGD", "k, loss / k, lr x k")]["params"]
    return {"runs": results, "undivided vs lr x k": drift(undivided, lr_x_k)}


# ---------------------------------------------------------------- printing


def format_table(title: str, header: list[str], rows: list[list[str]], note: str = "") -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([title, rule, line(header), rule] + [line(r) for r in rows] + [note, ""])


def kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f}"


def render(cfg: Config, device: torch.device, t1: dict, t2: dict, t3: dict, t4: dict) -> str:
    k, b = cfg.k, cfg.batch
    large1 = t1["large batch"]
    out = [
        format_table(
            f"1. Gradient of one window: k = {k} micro-batches of {b // k} samples, per-sample "
            f"cross-entropy, MLP width {cfg.width}, {device.type}",
            ["loop", "grad error", "saved KiB", "x large batch", "best ms"],
            [
                [
                    label,
                    f"{r['err']:.3e}",
                    kib(r["peak"]),
                    f"{r['peak'] / large1['peak']:.2f}",
                    f"{r['seconds'] * 1e3:.2f}",
                ]
                for label, r in t1.items()
            ],
            "grad error = |g - g_large| / |g_large|. saved KiB = peak bytes autograd holds for "
            "backward (activations:\nparameters and inputs not counted). best ms = fastest of "
            f"{cfg.reps} windows.",
        )
    ]
    out.append(
        format_table(
            f"2. Unequal micro-batches: tokens per micro-batch {list(t2['tokens'])}, token-level "
            "cross-entropy, one SGD step with lr = 1",
            ["loss per micro-batch, step", "step error", "token weight max/min"],
            [
                ["loss_j.mean() / k, step()", f"{t2['mean of means']:.3e}", f"{t2['weight ratio']:.2f}"],
                ["loss_j.sum(), step(num_items=N)", f"{t2['num_items']:.3e}", "1.00"],
            ],
            "step error = |step - step_large| / |step_large|. token weight: how much more a token of "
            "the smallest\nmicro-batch counts than one of the largest (1 in the large batch).",
        )
    )
    out.append(
        format_table(
            f"3. Contrastive loss (InfoNCE, in-batch negatives): {b} pairs, k = {k}, dual encoder",
            ["loop", "negatives", "loss", "grad error", "saved KiB", "best ms"],
            [
                [
                    label,
                    str(r["negatives"]),
                    f"{r['loss']:.4f}",
                    f"{r['err']:.3e}",
                    kib(r["peak"]),
                    f"{r['seconds'] * 1e3:.2f}",
                ]
                for label, r in t3.items()
            ],
            "negatives: documents each query is contrasted with. Columns as in table 1.",
        )
    )
    out.append(
        format_table(
            f"4. Learning rate: {cfg.steps} steps of {cfg.lr_batch} samples (large batch, or k = {k} "
            f"micro-batches of {cfg.lr_batch // k}), FusedAccumOptimizer",
            ["optimizer, accumulation", "lr", "final eval loss", "drift from large batch"],
            [
                [f"{opt}, {label}", f"{r['lr']:g}", f"{r['curve'][-1]:.4f}", f"{r['drift']:.2e}"]
                for (opt, label), r in t4["runs"].items()
            ],
            "drift = |theta - theta_large| / |theta_large - theta_0| after the last step: 0 is the "
            "large batch's\ntrajectory, 1 or more another one.",
        )
    )
    out.append(answer(cfg, t1, t2, t3, t4))
    return "\n".join(out)


def sci(x: float) -> str:
    return "0" if x == 0 else f"{x:.0e}"


def answer(cfg: Config, t1: dict, t2: dict, t3: dict, t4: dict) -> str:
    """The two answers in plain words, every figure taken from the tables just measured."""
    k = cfg.k
    a, undivided, stacked = t1["A, loss / k"], t1["A, loss not divided"], t1["B, stacked"]
    c_a, c_stacked, c_cached = t3["A, loss / k"], t3["B, stacked"], t3["B, cached"]
    sgd = {label: r for (opt, label), r in t4["runs"].items() if opt == "SGD"}
    adam = {label: r for (opt, label), r in t4["runs"].items() if opt == "AdamW"}
    loops = [
        "Which loop? Use loop A (backward per micro-batch, step every k) and divide each",
        f"micro-batch's loss by k: its gradient is the large batch's (error {sci(a['err'])}),",
        f"and it saves the activations of one micro-batch only ({kib(a['peak'])} KiB against",
        f"{kib(t1['large batch']['peak'])} KiB for the large batch).",
        f"Not divided, the gradient is {k} (k) times too large (error {undivided['err']:.2f}).",
        "Loop B (stack the outputs, one backward) gives the same gradient",
        f"(error {sci(stacked['err'])}) but keeps all k graphs alive ({kib(stacked['peak'])} KiB):",
        "it saves no memory. You need B only when the loss couples samples across the batch:",
        f"with InfoNCE, loop A lets each query see {c_a['negatives']} negatives instead of",
        f"{c_stacked['negatives']}, a different loss",
        f"({c_a['loss']:.3f} vs {c_stacked['loss']:.3f})",
        f"and gradient (error {c_a['err']:.2f}), while B stacked (error {sci(c_stacked['err'])})",
        f"and B cached (error {sci(c_cached['err'])}) match the large batch; the cached form",
        f"holds one chunk at a time ({kib(c_cached['peak'])} KiB vs {kib(c_stacked['peak'])} KiB)",
        f"for {c_cached['seconds'] / c_stacked['seconds']:.1f}x the time of stacked here.",
        "With micro-batches of unequal size (tokens), the mean of per-micro-batch means is not",
        f"the large-batch mean (error {t2['mean of means']:.2f}); sum the losses and call",
        f"step(num_items=total) (error {sci(t2['num_items'])}).",
    ]
    rates = [
        "Which learning rate? With the loss divided by k, one accumulated step is one",
        "large-batch step: the same trajectory (drift from the large batch:",
        f"SGD {sci(sgd['k, loss / k']['drift'])}, AdamW {sci(adam['k, loss / k']['drift'])}),",
        "so keep the learning rate you would use for the large batch; accumulation by itself",
        "needs no change. Forgetting the division multiplies SGD's step by k",
        f"(drift {sgd['k, loss not divided']['drift']:.2f}, final eval loss",
        f"{sgd['k, loss not divided']['curve'][-1]:.2f} instead of",
        f"{sgd['large batch']['curve'][-1]:.2f}; it is exactly lr x k, drift",
        f"{sci(t4['undivided vs lr x k'])} from that run). AdamW divides by the gradient's own",
        f"scale and barely notices (drift {sci(adam['k, loss not divided']['drift'])}, through",
        "eps only; Adam with coupled L2 weight decay would shift more, as the decay term does",
        "not scale with the loss). If the lr was tuned at the micro-batch size, the effective",
        "batch is k times larger: the usual batch-size heuristics apply (linear scaling for",
        "SGD, about sqrt(k) for Adam, with warm-up), not the accumulation.",
    ]

    def fill(words: list[str]) -> str:
        return textwrap.fill(" ".join(words), width=96, break_on_hyphens=False)

    return "\n".join(["Answer", "------", fill(loops), "", fill(rates)])


def plot(path: str, cfg: Config, t4: dict) -> None:
    import matplotlib  # lazily: the demo without --plot needs no matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    styles = {  # the large batch wide and pale, so the runs that follow it show on top
        "large batch": dict(lw=4, alpha=0.35),
        "k, loss / k": dict(ls="--"),
        "k, loss not divided": dict(ls="-"),
        "k, loss / k, lr x k": dict(ls=":", lw=3),
    }
    for ax, opt in zip(axes, ("SGD", "AdamW")):
        for (o, label), run in t4["runs"].items():
            if o == opt:
                ax.plot(range(1, cfg.steps + 1), run["curve"], label=f"{label} (lr {run['lr']:g})", **styles[label])
        ax.set_title(f"{opt}: k = {cfg.k} micro-batches vs one large batch")
        ax.set_xlabel("optimizer step")
        ax.legend()
    axes[0].set_ylabel("eval loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fused_accum demo",
        description="Which accumulation loop, and which learning rate? Measured.",
    )
    parser.add_argument("--plot", metavar="PATH", help="write the table-4 loss curves to this PNG")
    parser.add_argument("--quick", action="store_true", help="small models, few steps (seconds)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else DEFAULT
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    # One CPU thread: these matrices (at most 256 x 256) gain nothing from intra-op threads,
    # and on 2 cores shared with other processes 2 threads made table 4 take 55 s instead of
    # 1.5 s (threads waiting on each other at every op).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    units = 6 + 3 + 4 + 7  # rows measured: tables 1, 2, 3 and training runs of table 4
    try:
        with tqdm(total=units, desc="measuring", unit="row", file=sys.stderr) as bar:
            t1 = table_loops(cfg, device, bar)
            t2 = table_unequal(cfg, device, bar)
            t3 = table_contrastive(cfg, device, bar)
            t4 = table_lr(cfg, device, bar)
    finally:
        torch.set_num_threads(threads)
    print(render(cfg, device, t1, t2, t3, t4))
    if args.plot:
        plot(args.plot, cfg, t4)
        print(f"loss curves written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
