"""OptimizerParamScheduler against the closed forms of Megatron's get_lr / get_wd, and its checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_megatron.optimizer import OptimizerParamScheduler, get_param_groups

INIT, MAX, MIN = 1e-5, 1e-3, 1e-4
W, D = 10, 100  # warm-up steps, decay steps


def _opt(n_groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(n_groups)], lr=0.0)


def _sched(style: str = "linear", optimizer: torch.optim.Optimizer | None = None, **kw) -> OptimizerParamScheduler:
    args = dict(init_lr=INIT, max_lr=MAX, min_lr=MIN, lr_warmup_steps=W, lr_decay_steps=D, lr_decay_style=style,
                start_wd=0.01, end_wd=0.01, wd_incr_steps=D, wd_incr_style="constant")
    args.update(kw)
    return OptimizerParamScheduler(optimizer or _opt(), **args)


def _lr_at(s: OptimizerParamScheduler, n: int) -> float:
    s.num_steps = 0
    s.step(n)
    return s.optimizer.param_groups[0]["lr"]


def _closed_form(style: str, n: int, wsd: str | None = None, S: int = 30) -> float:
    """The schedule written out independently from the implementation."""
    if n <= W:
        return INIT + (MAX - INIT) * n / W
    if style == "constant":
        return MAX
    if n > D:
        return MIN
    if style == "inverse-square-root":
        return max(MIN, MAX * math.sqrt(W) / math.sqrt(n))
    r = (n - W) / (D - W)
    if style == "linear":
        c = 1 - r
    elif style == "cosine":
        c = (1 + math.cos(math.pi * r)) / 2
    else:  # WSD: flat until D - S, then anneal over S steps
        s = max(0.0, (n - (D - S)) / S)
        c = {"linear": 1 - s, "cosine": (1 + math.cos(math.pi * s)) / 2,
             "exponential": 2 * 0.5**s - 1, "minus_sqrt": 1 - math.sqrt(s)}[wsd]
    return MIN + c * (MAX - MIN)


STEPS = [0, 1, 5, 10, 11, 40, 55, 69, 70, 71, 85, 99, 100, 101, 250]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_lr_decay_styles_match_closed_form(style):
    s = _sched(style)
    for n in STEPS:
        assert _lr_at(s, n) == pytest.approx(_closed_form(style, n), rel=1e-12, abs=0), (style, n)


@pytest.mark.parametrize("wsd", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_wsd_styles_match_closed_form(wsd):
    s = _sched("WSD", wsd_decay_steps=30, lr_wsd_decay_style=wsd)
    for n in STEPS:
        assert _lr_at(s, n) == pytest.approx(_closed_form("WSD", n, wsd), rel=1e-12, abs=1e-18), (wsd, n)
    # Flat at max_lr through the stable phase, min_lr exactly at the end of the anneal.
    assert _lr_at(s, 70) == MAX and _lr_at(s, 100) == pytest.approx(MIN, abs=1e-18)


def test_spot_values():
    """A few numbers worked by hand, so a shared mistake in closed form and code cannot hide."""
    assert _lr_at(_sched("linear"), 55) == pytest.approx(MIN + 0.5 * (MAX - MIN))
    assert _lr_at(_sched("cosine"), 55) == pytest.approx(MIN + 0.5 * (MAX - MIN))
    assert _lr_at(_sched("linear"), 5) == pytest.approx((INIT + MAX) / 2)
    assert _lr_at(_sched("inverse-square-root"), 40) == pytest.approx(MAX / 2)
    assert _lr_at(_sched("WSD", wsd_decay_steps=30, lr_wsd_decay_style="exponential"), 100) == pytest.approx(MIN)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_wd_styles_match_closed_form(style):
    start, end, incr = (0.05, 0.05, 50) if style == "constant" else (0.01, 0.1, 50)
    s = _sched(start_wd=start, end_wd=end, wd_incr_steps=incr, wd_incr_style=style)
    for n in [0, 1, 10, 25, 49, 50, 51, 200]:
        s.num_steps = 0
        s.step(n)
        r = min(n / incr, 1.0)
        c = {"constant": 1.0, "linear": r, "cosine": (1 + math.cos(math.pi * (1 - r))) / 2}[style]
        want = end if n > incr else start + c * (end - start)
        assert s.optimizer.param_groups[0]["weight_decay"] == pytest.approx(want, rel=1e-12), (style, n)
    if style == "cosine":
        s.num_steps = 0
        s.step(25)
        assert s.get_wd() == pytest.approx((start + end) / 2)


def test_construction_sets_step0_values_and_per_group_overrides():
    opt = _opt(3)
    opt.param_groups[1].update(max_lr=2e-3, min_lr=0.0, wd_mult=0.0)
    opt.param_groups[2].update(lr_mult=0.5, start_wd=0.0, end_wd=0.2)
    s = _sched("linear", optimizer=opt, start_wd=0.0, end_wd=0.1, wd_incr_style="linear")
    assert [g["lr"] for g in opt.param_groups] == [INIT, INIT, INIT * 0.5]
    s.step(55)
    g0, g1, g2 = opt.param_groups
    assert g0["lr"] == pytest.approx(MIN + 0.5 * (MAX - MIN))
    assert g1["lr"] == pytest.approx(0.5 * 2e-3) and g1["weight_decay"] == 0.0
    assert g2["lr"] == pytest.approx(0.5 * g0["lr"])
    assert g0["weight_decay"] == pytest.approx(0.055) and g2["weight_decay"] == pytest.approx(0.11)


def test_state_dict_keys_and_round_trip():
    s = _sched("cosine")
    s.step(37)
    sd = s.state_dict()
    assert set(sd) == {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
                       "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps",  # Megatron's, and what decides the
                       "init_lr", "wsd_decay_steps", "lr_wsd_decay_style"}  # warm-up's start and WSD's anneal
    t = _sched("cosine")
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    assert t.optimizer.param_groups[0]["lr"] == s.optimizer.param_groups[0]["lr"]
    t.load_state_dict(sd)  # loading twice restores, does not add steps
    assert t.num_steps == 37


def test_load_use_checkpoint_override_and_mismatch():
    saved = _sched("linear", max_lr=2e-3)
    saved.step(20)
    sd = saved.state_dict()
    # use-checkpoint (default): the checkpoint's values win.
    a = _sched("cosine")
    a.load_state_dict(sd)
    assert (a.max_lr, a.lr_decay_style, a.num_steps) == (2e-3, "linear", 20)
    # override: the constructor's values win; only the step count comes from the checkpoint.
    b = _sched("cosine", use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    b.load_state_dict(sd)
    assert (b.max_lr, b.lr_decay_style, b.num_steps) == (MAX, "cosine", 20)
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(_closed_form("cosine", 20))
    # neither: values must agree.
    c = _sched("cosine", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="max_lr: configured 0.001, checkpoint 0.002; lr_decay_style"):
        c.load_state_dict(sd)
    with pytest.raises(ValueError, match="contradict"):
        _sched(use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=True)


def test_the_warm_up_start_and_the_wsd_anneal_are_the_checkpoints_too():
    """init_lr, wsd_decay_steps and lr_wsd_decay_style decide the lr as much as max_lr does, and Megatron's state
    leaves them out: a resume silently took the configured ones (another anneal length, another warm-up start),
    even with neither flag, and a WSD checkpoint resumed under another style raised a TypeError (the checkpoint's
    WSD without its anneal length). They follow the same rule as every field now; a difference that changes no
    value (the warm-up's start after the warm-up, WSD's fields of another style) is none."""
    saved = _sched("WSD", wsd_decay_steps=40, lr_wsd_decay_style="linear")
    saved.step(70)
    sd = saved.state_dict()
    a = _sched("WSD", wsd_decay_steps=20, lr_wsd_decay_style="cosine")  # use the checkpoint's (the default)
    a.load_state_dict(sd)
    assert (a.wsd_decay_steps, a.lr_wsd_decay_style) == (40, "linear")
    assert a.optimizer.param_groups[0]["lr"] == pytest.approx(_closed_form("WSD", 70, "linear", S=40))
    assert {name for name, *_ in a.resume_differences} == {"wsd_decay_steps", "lr_wsd_decay_style"}
    b = _sched("cosine")  # another style: the checkpoint's WSD with its anneal
    b.load_state_dict(sd)
    assert (b.lr_decay_style, b.wsd_decay_steps) == ("WSD", 40)
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(_closed_form("WSD", 70, "linear", S=40))
    c = _sched("WSD", wsd_decay_steps=20, lr_wsd_decay_style="linear", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="wsd_decay_steps: configured 20, checkpoint 40"):
        c.load_state_dict(sd)
    d = _sched("WSD", wsd_decay_steps=20, lr_wsd_decay_style="cosine", use_checkpoint_opt_param_scheduler=False,
               override_opt_param_scheduler=True)
    d.load_state_dict(sd)
    assert d.optimizer.param_groups[0]["lr"] == pytest.approx(_closed_form("WSD", 70, "cosine", S=20))
    # the warm-up's start, mid-warm-up
    warm = _sched("cosine", init_lr=2e-4)
    warm.step(4)
    e = _sched("cosine", init_lr=5e-4)
    e.load_state_dict(warm.state_dict())
    assert e.init_lr == 2e-4 and e.optimizer.param_groups[0]["lr"] == pytest.approx(2e-4 + (MAX - 2e-4) * 4 / W)
    # ... after the warm-up, and WSD's fields under another style, change no value: no difference, no error
    after = _sched("cosine", init_lr=2e-4)
    after.step(30)
    f = _sched("cosine", init_lr=5e-4, wsd_decay_steps=7, lr_wsd_decay_style="linear",
               use_checkpoint_opt_param_scheduler=False)
    f.load_state_dict(after.state_dict())
    assert f.resume_differences == [] and f.num_steps == 30
    # a WSD checkpoint of before (Megatron's keys only) resumed under another style: said, not a TypeError
    g = _sched("cosine")
    old = {k: v for k, v in sd.items() if k not in ("init_lr", "wsd_decay_steps", "lr_wsd_decay_style")}
    with pytest.raises(ValueError, match="lr_decay_style='WSD' of the checkpoint needs wsd_decay_steps"):
        g.load_state_dict(old)


def test_load_legacy_keys():
    legacy = {"start_lr": 3e-3, "min_lr": 1e-5, "warmup_iter": 4, "end_iter": 40, "decay_style": "cosine",
              "num_iters": 22}
    s = _sched("linear")
    s.load_state_dict(legacy)
    assert (s.max_lr, s.min_lr, s.lr_warmup_steps, s.lr_decay_steps, s.lr_decay_style, s.num_steps) == (
        3e-3, 1e-5, 4, 40, "cosine", 22)
    assert s.start_wd == 0.01  # no wd keys in old checkpoints: constructor values kept
    r = (22 - 4) / (40 - 4)
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(1e-5 + (1 + math.cos(math.pi * r)) / 2 * (3e-3 - 1e-5))
    t = _sched("linear")
    t.load_state_dict({"max_lr": MAX, "min_lr": MIN, "warmup_steps": 7, "decay_steps": 77,
                       "lr_decay_style": "linear", "num_steps": 3})
    assert (t.lr_warmup_steps, t.lr_decay_steps, t.num_steps) == (7, 77, 3)


@pytest.mark.parametrize("kw, field", [
    (dict(min_lr=-1.0), "min_lr"), (dict(max_lr=1e-5, min_lr=1e-4), "max_lr"), (dict(init_lr=1.0), "init_lr"),
    (dict(lr_decay_steps=0), "lr_decay_steps"), (dict(lr_warmup_steps=100), "lr_warmup_steps"),
    (dict(lr_decay_style="step"), "lr_decay_style"), (dict(lr_decay_style="WSD"), "wsd_decay_steps"),
    (dict(lr_decay_style="WSD", wsd_decay_steps=5), "lr_wsd_decay_style"),
    (dict(start_wd=0.1, end_wd=0.01, wd_incr_style="linear"), "end_wd"),
    (dict(start_wd=0.0, end_wd=0.1), "start_wd == end_wd"), (dict(wd_incr_style="exp"), "wd_incr_style"),
])
def test_invalid_arguments(kw, field):
    with pytest.raises(ValueError, match=field):
        _sched(**kw)


def test_param_groups_no_decay_on_bias_and_norm():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    groups = get_param_groups(model, lr=0.1, weight_decay=0.05)
    by_id = {id(p): g for g in groups for p in g["params"]}
    assert by_id[id(model[0].weight)]["wd_mult"] == 1.0 and by_id[id(model[2].weight)]["wd_mult"] == 1.0
    for p in (model[0].bias, model[1].weight, model[1].bias):
        assert by_id[id(p)]["wd_mult"] == 0.0 and by_id[id(p)]["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in groups) == 5
    everything = get_param_groups(model, lr=0.1, weight_decay=0.05, no_weight_decay_cond=None)
    assert len(everything) == 1 and everything[0]["weight_decay"] == 0.05
    scaled = get_param_groups(model, lr=0.1, weight_decay=0.05, lr_mult=10.0,
                              scale_lr_cond=lambda name, p: name.startswith("2."))
    head = next(g for g in scaled if any(p is model[2].weight for p in g["params"]))
    assert head["lr_mult"] == 10.0 and head["lr"] == pytest.approx(1.0)
    # The scheduler keeps the multipliers: wd 0 on norms/biases, lr x10 on the head.
    opt = torch.optim.AdamW(scaled, lr=0.1)
    s = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=0.1, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                                lr_decay_style="constant", start_wd=0.05, end_wd=0.05, wd_incr_steps=10,
                                wd_incr_style="constant")
    s.step(1)
    assert head["lr"] == pytest.approx(1.0) and head["weight_decay"] == pytest.approx(0.05)
    nodecay = next(g for g in opt.param_groups if g["wd_mult"] == 0.0)
    assert nodecay["weight_decay"] == 0.0 and nodecay["lr"] == pytest.approx(0.1)


def test_warmup_longer_than_decay_gets_one_answer_everywhere():
    """Warm-up >= decay: an explicit ``lr_decay_steps`` is refused with one message by the scheduler
    (at set-up) and by the pre-launch check; with ``lr_decay_steps=None`` (the run's length) the
    warm-up is shortened to 10% of the run, with a warning, by the schedule callback at set-up, for
    the CLI and for Python alike, and the pre-launch check reports nothing."""
    from types import SimpleNamespace

    from lightning_megatron.callbacks import OptimizerParamSchedulerCallback
    from lightning_megatron.config_checks import check_config
    from lightning_megatron.optimizer.scheduler import warmup_for_run, warmup_problem

    message = warmup_problem(50, 20)
    assert message == "lr_warmup_steps=50 must be < lr_decay_steps=20; shorten the warm-up or decay later"
    with pytest.raises(ValueError) as e:
        _sched(lr_warmup_steps=50, lr_decay_steps=20)
    assert str(e.value) == message
    args = dict(init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=50)
    assert check_config(scheduler_args={**args, "lr_decay_steps": 20}, trainer_args={"max_steps": 100}) == [message]

    assert warmup_for_run(30, 20)[0] == 2 and warmup_for_run(10, 20) == (10, None)
    assert check_config(scheduler_args={**args, "lr_decay_steps": None}, trainer_args={"max_steps": 20}) == []
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    callback = OptimizerParamSchedulerCallback(**{**args, "lr_warmup_steps": 30})
    trainer = SimpleNamespace(lr_scheduler_configs=[], optimizers=[opt], max_steps=20, fast_dev_run=False)
    with pytest.warns(UserWarning, match=r"lr_warmup_steps=30 is not below the decay length 20 .* using "
                                         r"lr_warmup_steps=2"):
        callback.on_fit_start(trainer, None)
    assert callback.scheduler.lr_warmup_steps == 2 and callback.scheduler.lr_decay_steps == 20
