"""Loss scalers: Megatron's dynamic update rule on overflow patterns, hysteresis, min clamp, state."""

from __future__ import annotations

import pytest
import torch

from lightning_megatron.optimizer import ConstantGradScaler, DynamicGradScaler


def _dyn(**kw) -> DynamicGradScaler:
    args = dict(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                hysteresis=2)
    args.update(kw)
    return DynamicGradScaler(**args)


def _run(scaler: DynamicGradScaler, pattern: str) -> list[float]:
    """Scale after each step; pattern: 'x' = overflow, '.' = clean step."""
    out = []
    for c in pattern:
        scaler.update(c == "x")
        out.append(float(scaler.scale.item()))
    return out


S = 2.0**16


@pytest.mark.parametrize("pattern, hysteresis, expected", [
    # hysteresis 1: every overflow halves; 3 clean steps double.
    ("x..." , 1, [S / 2, S / 2, S / 2, S]),
    ("xx.x", 1, [S / 2, S / 4, S / 4, S / 8]),
    # hysteresis 2: the first overflow is tolerated, every later one halves (tracker stays <= 0) ...
    ("xxx", 2, [S, S / 2, S / 4]),
    # ... and clean steps do not reset the tracker, only a growth does.
    ("x.x", 2, [S, S, S / 2]),
    ("x...x", 2, [S, S, S, S * 2, S * 2]),
    ("x...xx", 2, [S, S, S, S * 2, S * 2, S]),
    # growth interval counts clean steps since the last overflow.
    ("..x...", 3, [S, S, S, S, S, S * 2]),
    ("......", 2, [S, S, S * 2, S * 2, S * 2, S * 4]),
])
def test_dynamic_sequences(pattern, hysteresis, expected):
    assert _run(_dyn(hysteresis=hysteresis), pattern) == expected


def test_min_scale_clamp_and_backoff_factor():
    s = _dyn(initial_scale=8.0, min_scale=2.0, hysteresis=1, backoff_factor=0.25)
    assert _run(s, "xxx") == [2.0, 2.0, 2.0]
    s = _dyn(initial_scale=8.0, min_scale=3.0, hysteresis=1)
    assert _run(s, "xx") == [4.0, 3.0]  # max(scale * backoff, min_scale), not a power of two


def test_inv_scale_and_trackers():
    s = _dyn(initial_scale=2.0**32)
    assert s.scale.dtype == torch.float32 and s.scale.shape == (1,)
    assert float(s.inv_scale.item()) == 2.0**-32
    _run(s, "x..")
    assert s.state_dict()["growth_tracker"] == 2 and s.state_dict()["hysteresis_tracker"] == 1


def test_state_dict_round_trip_continues_identically():
    a = _dyn(hysteresis=2)
    _run(a, "x..x.")
    sd = a.state_dict()
    assert set(sd) == {"scale", "growth_tracker", "hysteresis_tracker"}
    b = _dyn(initial_scale=4.0)
    b.load_state_dict(sd)
    assert b.state_dict()["scale"].equal(sd["scale"]) and b.state_dict()["growth_tracker"] == sd["growth_tracker"]
    assert _run(a, "..xx...x") == _run(b, "..xx...x")


def test_constant_scaler():
    s = ConstantGradScaler(1024.0)
    assert _run(s, "x.x.") == [1024.0] * 4 and s.state_dict() == {}
    assert float(s.inv_scale.item()) == 1.0 / 1024


@pytest.mark.parametrize("kw, field", [
    (dict(initial_scale=0.0), "initial_scale"), (dict(min_scale=0.0), "min_scale"),
    (dict(min_scale=2.0**20), "min_scale"), (dict(growth_factor=1.0), "growth_factor"),
    (dict(backoff_factor=1.0), "backoff_factor"), (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(growth_interval=0), "growth_interval"), (dict(hysteresis=0), "hysteresis"),
])
def test_invalid_arguments(kw, field):
    with pytest.raises(ValueError, match=field):
        _dyn(**kw)
    with pytest.raises(ValueError, match="initial_scale"):
        ConstantGradScaler(-1.0)
