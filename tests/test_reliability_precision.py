"""Precision under MegatronStrategy: bf16-mixed really autocasts; mismatches and unsafe settings are refused."""

from __future__ import annotations

import torch

from dist_utils import run_distributed
from megatron_testing import TINY_CONFIG, TINY_MODEL, TINY_OPTIONS, LossRecorder, dataloader, make_trainer

MICRO, BATCH = 4, 8


def _trainer_losses(precision: str, params_dtype: str = "float32", callback: bool = True, plugins=None,
                    steps: int = 1) -> list[float] | str:
    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    recorder = LossRecorder()
    callbacks = [recorder] + ([MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.0))] if callback else [])
    kwargs = {"plugins": plugins} if plugins else {"precision": precision}
    trainer = make_trainer(MegatronStrategy(micro_batch_size=MICRO), 1, steps, callbacks=callbacks, **kwargs)
    try:
        trainer.fit(BertLightningModule(BertConfig(**TINY_CONFIG, params_dtype=params_dtype), **TINY_OPTIONS),
                    train_dataloaders=dataloader(BATCH, 1, 0))
    except ValueError as e:
        assert not recorder.losses, "refused only after training started"
        return str(e)
    return recorder.losses


def _reference_loss(autocast: bool) -> float:
    """The first step's loss without the Trainer: the same weights, two microbatches, optional autocast."""
    from lightning_megatron.models.bert.module import BertLightningModule

    module = BertLightningModule(**TINY_MODEL)
    module.configure_model()
    batch = next(iter(dataloader(BATCH, 1, 0)))
    losses = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for i in range(0, BATCH, MICRO):
            micro = {k: v[i:i + MICRO] for k, v in batch.items()}
            loss, _ = module.forward_step(micro, module.model_chunks[0])
            losses.append(loss.detach().float())
    return float(torch.stack(losses).mean())


def _autocast_worker() -> dict:
    return {"fp32": _trainer_losses("32-true")[0], "bf16_mixed": _trainer_losses("bf16-mixed")[0],
            "ref_fp32": _reference_loss(False), "ref_autocast": _reference_loss(True)}


def test_bf16_mixed_autocasts_and_differs_from_fp32():
    r = run_distributed(_autocast_worker, 1, timeout=300)[0]
    # The reference reproduces the Trainer's fp32 loss, so it is a valid reference...
    assert abs(r["fp32"] - r["ref_fp32"]) <= 1e-6 * abs(r["ref_fp32"]), r
    # ...bf16-mixed equals the autocast reference...
    assert abs(r["bf16_mixed"] - r["ref_autocast"]) <= 1e-6 * abs(r["ref_autocast"]), r
    # ...and is not fp32: the autocast reference itself is measurably different from fp32.
    assert abs(r["ref_autocast"] - r["ref_fp32"]) > 1e-6 * abs(r["ref_fp32"]), r
    assert r["bf16_mixed"] != r["fp32"], r


def _refusal_worker() -> dict:
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    return {
        "32_true_bf16_params": _trainer_losses("32-true", "bfloat16"),
        "bf16_true_fp32_params": _trainer_losses("bf16-true", "float32"),
        "bf16_mixed_bf16_params": _trainer_losses("bf16-mixed", "bfloat16"),
        "fp16_no_callback": _trainer_losses("16-true", "float16", callback=False),
        "bf16_no_callback": _trainer_losses("bf16-true", "bfloat16", callback=False),
        "grad_scaler": _trainer_losses("16-mixed", plugins=[scaler_plugin]),
        "64_true": _trainer_losses("64-true"),
        "bf16_true_ok": _trainer_losses("bf16-true", "bfloat16"),
    }


def test_precision_mismatches_and_unsafe_settings_are_refused():
    r = run_distributed(_refusal_worker, 1, timeout=300)[0]
    msg = r["32_true_bf16_params"]
    assert "precision='32-true'" in msg and "torch.bfloat16" in msg and "params_dtype='bfloat16'" in msg, msg
    assert "precision='bf16-true'" in msg, msg  # the fix
    msg = r["bf16_true_fp32_params"]
    assert "precision='bf16-true'" in msg and "params_dtype='float32'" in msg and "'32-true'" in msg, msg
    msg = r["bf16_mixed_bf16_params"]
    assert "precision='bf16-mixed'" in msg and "params_dtype='bfloat16'" in msg, msg
    for key, dtype in (("fp16_no_callback", "float16"), ("bf16_no_callback", "bfloat16")):
        msg = r[key]
        assert f"torch.{dtype} parameters" in msg and "MegatronOptimizerCallback" in msg, msg
    msg = r["grad_scaler"]
    assert "precision='16-mixed'" in msg and "GradScaler" in msg and "bf16-mixed" in msg, msg
    assert "precision='64-true' is not supported" in r["64_true"], r["64_true"]
    assert isinstance(r["bf16_true_ok"], list) and len(r["bf16_true_ok"]) == 1, r["bf16_true_ok"]
