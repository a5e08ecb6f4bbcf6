"""Draw docs/img/schedules.png: every lr decay style and weight-decay style of our OptimizerParamScheduler.

The curves are read from :class:`lightning_megatron.optimizer.OptimizerParamScheduler` itself
(stepped one step at a time on a one-parameter SGD optimizer), not from re-typed formulas.

Run: ``.venv/bin/python docs/_scripts/plot_schedules.py``
"""

from __future__ import annotations

import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)

from lightning_megatron.optimizer import OptimizerParamScheduler  # noqa: E402

STEPS, WARMUP, DECAY, WSD_DECAY = 1200, 100, 1000, 300
INIT_LR, MAX_LR, MIN_LR = 0.0, 3e-4, 3e-5


def curve(**kwargs) -> tuple[list[float], list[float]]:
    """lr and weight decay at steps 0..STEPS, as the scheduler sets them on the param group."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    args = dict(init_lr=INIT_LR, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP, lr_decay_steps=DECAY,
                lr_decay_style="linear", start_wd=0.01, end_wd=0.01, wd_incr_steps=DECAY,
                wd_incr_style="constant")
    args.update(kwargs)
    sched = OptimizerParamScheduler(opt, **args)
    lrs, wds = [], []
    for _ in range(STEPS + 1):
        lrs.append(opt.param_groups[0]["lr"])
        wds.append(opt.param_groups[0]["weight_decay"])
        sched.step(1)
    return lrs, wds


def main() -> None:
    fig, (ax_lr, ax_wsd, ax_wd) = plt.subplots(1, 3, figsize=(16, 4.6))
    for style in ("constant", "linear", "cosine", "inverse-square-root"):
        ax_lr.plot(curve(lr_decay_style=style)[0], label=style)
    ax_lr.set_title(f"lr_decay_style (warm-up {WARMUP}, decay to step {DECAY})")
    for style in ("linear", "cosine", "exponential", "minus_sqrt"):
        ax_wsd.plot(curve(lr_decay_style="WSD", wsd_decay_steps=WSD_DECAY, lr_wsd_decay_style=style)[0],
                    label=f"WSD, {style}")
    ax_wsd.set_title(f"WSD: stable, then anneal over the last {WSD_DECAY} steps")
    for style, (start, end) in (("constant", (0.05, 0.05)), ("linear", (0.01, 0.1)), ("cosine", (0.01, 0.1))):
        ax_wd.plot(curve(start_wd=start, end_wd=end, wd_incr_style=style)[1], label=f"{style} {start} -> {end}")
    ax_wd.set_title(f"wd_incr_style (over {DECAY} steps)")
    for ax in (ax_lr, ax_wsd):
        ax.axhline(MIN_LR, color="grey", lw=0.6, ls=":")
        ax.set_ylabel("learning rate")
    ax_wd.set_ylabel("weight decay")
    for ax in (ax_lr, ax_wsd, ax_wd):
        ax.axvline(DECAY, color="grey", lw=0.6, ls="--")
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"OptimizerParamScheduler: init_lr={INIT_LR}, max_lr={MAX_LR}, min_lr={MIN_LR}")
    fig.tight_layout()
    out = os.path.join(ROOT, "docs", "img", "schedules.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
