"""Sharded checkpoints: exact resume, resharding across TP, DP and PP, and corrupt checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import TINY_CONFIG, TINY_MODEL, TINY_OPTIONS, LossRecorder, make_trainer, synthetic_datamodule

GLOBAL_BATCH, MICRO = 8, 2


def _run(tp: int, pp: int, world: int, max_steps: int, *, ckpt_in: str | None = None, save_to: str | None = None,
         validate: bool = False, fit: bool = True) -> dict:
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    strategy = MegatronStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    module = BertLightningModule(**TINY_MODEL)
    recorder = LossRecorder()
    trainer = make_trainer(strategy, world, max_steps, callbacks=[recorder], limit_val_batches=None)
    dims = strategy.parallel_dims.for_world_size(trainer.world_size)
    dm = synthetic_datamodule(GLOBAL_BATCH, MICRO, dims.dp, dims.coordinates(torch.distributed.get_rank())["dp"])
    out: dict = {}
    if fit:
        import warnings

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt_in)
        out["warnings"] = [str(w.message) for w in said]
        out["losses"] = recorder.losses
        if save_to:
            trainer.save_checkpoint(save_to)
    if validate:
        import warnings

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            [metrics] = trainer.validate(module, datamodule=dm, ckpt_path=None if fit else ckpt_in, verbose=False)
        out["validate_warnings"] = [str(w.message) for w in said]
        out["val_loss"] = float(metrics["val_loss"])
        out["val_metrics"] = {k: float(metrics[k]) for k in ("val_mlm_accuracy", "val_perplexity")}
    return out


def _resume_and_reshard_worker(root: str) -> dict:
    world = 4
    straight = _run(2, 1, world, 20)
    first = _run(2, 1, world, 10, save_to=f"{root}/tp2dp2", validate=True)
    resumed = _run(2, 1, world, 20, ckpt_in=f"{root}/tp2dp2")
    at_tp4 = _run(4, 1, world, 0, ckpt_in=f"{root}/tp2dp2", validate=True, fit=False)
    at_tp1 = _run(1, 1, world, 0, ckpt_in=f"{root}/tp2dp2", validate=True, fit=False)
    resumed_tp4 = _run(4, 1, world, 20, ckpt_in=f"{root}/tp2dp2")
    pp2 = _run(1, 2, world, 6, save_to=f"{root}/pp2dp2", validate=True)
    pp_to_pp1 = _run(1, 1, world, 0, ckpt_in=f"{root}/pp2dp2", validate=True, fit=False)
    return dict(straight=straight, first=first, resumed=resumed, at_tp4=at_tp4, at_tp1=at_tp1,
                resumed_tp4=resumed_tp4, pp2=pp2, pp_to_pp1=pp_to_pp1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    results = run_distributed(_resume_and_reshard_worker, 4, str(root), timeout=600)
    return root, results[0]


def test_resume_equals_straight_run(runs):
    _, r = runs
    straight = torch.tensor(r["straight"]["losses"])
    assert len(straight) == 20
    torch.testing.assert_close(torch.tensor(r["first"]["losses"]), straight[:10], rtol=1e-6, atol=0)
    # 10 steps, save, resume, 10 more: same losses as 20 straight steps (same data order, optimizer state).
    torch.testing.assert_close(torch.tensor(r["resumed"]["losses"]), straight[10:], rtol=1e-6, atol=0)


def test_reshard_tp2dp2_to_tp4_and_tp1(runs):
    _, r = runs
    val = r["first"]["val_loss"]
    assert abs(r["at_tp4"]["val_loss"] - val) <= 1e-5 * abs(val)
    assert abs(r["at_tp1"]["val_loss"] - val) <= 1e-5 * abs(val)
    # The torchmetrics of the whole split, synchronised over the data-parallel group only: the same at
    # TP=2 x DP=2, TP=4 x DP=1 and TP=1 x DP=4 (TP ranks, which hold the same predictions, count once).
    for other in ("at_tp4", "at_tp1"):
        for key, value in r["first"]["val_metrics"].items():
            assert r[other]["val_metrics"][key] == pytest.approx(value, rel=1e-5), (other, key)
    assert 0.0 <= r["first"]["val_metrics"]["val_mlm_accuracy"] <= 1.0 and r["first"]["val_metrics"]["val_perplexity"] > 1
    # Training resumes at TP=4 with the optimizer state intact: it follows the straight TP=2 x DP=2 run.
    torch.testing.assert_close(torch.tensor(r["resumed_tp4"]["losses"]),
                               torch.tensor(r["straight"]["losses"][10:]), rtol=1e-5, atol=0)
    # Its ranks' RNG states are not the checkpoint's (another rank per state): said (was silent), not at the same layout
    rng = [w for w in r["resumed_tp4"]["warnings"] if "RNG" in w]
    assert len(rng) == 1 and "saved at tp=2, pp=1, dp=2; this run is tp=4, pp=1, dp=1" in rng[0], rng
    assert not [w for w in r["resumed"]["warnings"] if "RNG" in w], r["resumed"]["warnings"]
    # an evaluation at another layout restores no RNG state either, but it draws no dropout: nothing to say (it said
    # "the run goes on alike, not bit for bit")
    assert not [w for k in ("at_tp4", "at_tp1") for w in r[k]["validate_warnings"] if "RNG" in w], r["at_tp4"]


def test_reshard_pp2_to_pp1(runs):
    _, r = runs
    val = r["pp2"]["val_loss"]
    assert abs(r["pp_to_pp1"]["val_loss"] - val) <= 1e-5 * abs(val)
    for key, value in r["pp2"]["val_metrics"].items():  # computed on the last stage, broadcast along the pipeline
        assert r["pp_to_pp1"]["val_metrics"][key] == pytest.approx(value, rel=1e-5), key


def _load_broken_worker(path: str) -> str:
    try:
        _run(2, 1, 2, 12, ckpt_in=path)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_corrupt_and_partial_checkpoints_give_clear_errors(runs, tmp_path):
    root, _ = runs
    truncated = tmp_path / "truncated"
    shutil.copytree(root / "tp2dp2", truncated)
    shard = sorted(truncated.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    partial = tmp_path / "partial"
    shutil.copytree(root / "tp2dp2", partial)
    (partial / "lightning_megatron.json").unlink()
    messages = run_distributed(_load_broken_worker, 2, str(truncated), timeout=300)
    assert "CheckpointError" in messages[0] and "truncated" in messages[0], messages[0]
    messages = run_distributed(_load_broken_worker, 2, str(partial), timeout=300)
    assert "CheckpointError" in messages[0] and "incomplete" in messages[0], messages[0]
    # No leftover temporary directories next to the saved checkpoints.
    assert not [p for p in Path(root).iterdir() if ".tmp-" in p.name]


def _fp16_run(max_steps: int, save_to: str | None = None, ckpt_in: str | None = None) -> dict:
    """TP=2, fp16 params, dynamic loss scaling from 2^20 and the OptimizerParamScheduler."""
    from lightning.pytorch import Callback

    from lightning_megatron.callbacks import MegatronOptimizerCallback, OptimizerParamSchedulerCallback
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    class Trace(Callback):
        def __init__(self) -> None:
            self.rows: list[tuple[float, float, float, int]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            opt = trainer.strategy.optimizers[0]
            self.rows.append((float(outputs["loss"]), float(opt.get_loss_scale()),
                              float(opt.param_groups[0]["lr"]), int(opt.num_skipped_steps)))

    strategy = MegatronStrategy(tensor_model_parallel_size=2)
    trace = Trace()
    callbacks = [MegatronOptimizerCallback(OptimizerConfig(clip_grad=1.0, initial_loss_scale=2.0**20, loss_scale_window=3,
                                           hysteresis=1)),
                 OptimizerParamSchedulerCallback(max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=2, lr_decay_steps=12,
                                                 lr_decay_style="cosine"), trace]
    trainer = make_trainer(strategy, 2, max_steps, callbacks=callbacks, precision="16-true")
    dm = synthetic_datamodule(GLOBAL_BATCH, MICRO, 1, 0)
    module = BertLightningModule(BertConfig(**TINY_CONFIG, params_dtype="float16"), **TINY_OPTIONS)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_in)
    if save_to:
        trainer.save_checkpoint(save_to)
    return {"rows": trace.rows}


def _fp16_worker(root: str) -> dict:
    return {"straight": _fp16_run(12), "first": _fp16_run(6, save_to=f"{root}/fp16"),
            "resumed": _fp16_run(12, ckpt_in=f"{root}/fp16")}


def test_fp16_loss_scaling_and_scheduler_state_survive_resume(tmp_path):
    r = run_distributed(_fp16_worker, 2, str(tmp_path), timeout=600)[0]
    straight = r["straight"]["rows"]
    scales = [row[1] for row in straight]
    # The scale starts too high for fp16 grads: steps overflow, are skipped, the scale backs off...
    assert straight[-1][3] >= 1 and min(scales) < 2.0**20
    # ...and training still moves on with finite losses.
    assert all(torch.isfinite(torch.tensor([row[0] for row in straight])))
    # Resumed from step 6: losses, loss scale, lr and skip count continue exactly.
    assert r["first"]["rows"] == straight[:6]
    assert r["resumed"]["rows"] == straight[6:]


def _precision_worker(root: str) -> dict:
    """A run saved in one precision and resumed in the other (restored at its step, nothing trained), TP=2 with the
    plain optimizer and DP=2 with ZeRO-1: each rank's parameters (but the word embedding: its padding rows are the
    layout's) and their fp32 mains, after the first run and after the restore."""
    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.models.bert.config import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.optimizer.config import OptimizerConfig
    from lightning_megatron.strategy import MegatronStrategy

    def run(dtype: str, tp: int, zero1: bool, ckpt_in: str | None = None, save_to: str | None = None) -> dict:
        callback = MegatronOptimizerCallback(OptimizerConfig(clip_grad=1.0, use_distributed_optimizer=zero1))
        trainer = make_trainer(MegatronStrategy(tensor_model_parallel_size=tp), 2, 4, callbacks=[callback],
                               precision={"float32": "32-true", "bfloat16": "bf16-true", "float16": "16-true"}[dtype])
        module = BertLightningModule(BertConfig(**TINY_CONFIG, params_dtype=dtype), lr=1e-2, weight_decay=0.01)
        dp = 2 // tp
        trainer.fit(module, datamodule=synthetic_datamodule(GLOBAL_BATCH, MICRO, dp, torch.distributed.get_rank() % dp),
                    ckpt_path=ckpt_in)
        if save_to:
            trainer.save_checkpoint(save_to)
        opt = trainer.strategy.optimizers[0]
        kept = [p for n, p in module.named_parameters() if "word_embeddings" not in n]
        if zero1:  # the mains of this rank's shard, as the parameters' flat ranges
            pieces = [pc for pc in opt.sharded_state_for_checkpoint() if any(pc["param"] is p for p in kept)]
            mains = [(pc["tensors"]["main_param"], pc["param"].detach().reshape(-1)[pc["start"]:pc["end"]])
                     for pc in pieces]
            return {"param": torch.cat([q.float() for _, q in mains]), "main": torch.cat([m for m, _ in mains])}
        return {"param": torch.cat([p.detach().float().reshape(-1) for p in kept]),
                "main": torch.cat([opt.main_param(p).detach().float().reshape(-1) for p in kept])}

    out = {}
    for tp, zero1 in ((2, False), (1, True)):
        for first, second in (("float32", "bfloat16"), ("bfloat16", "float32")):
            path = f"{root}/{first}_tp{tp}_zero1{zero1}"
            out[(tp, zero1, first)] = (run(first, tp, zero1, save_to=path), run(second, tp, zero1, ckpt_in=path))
    # bf16 -> fp16: its dynamic loss scale starts at its initial value (the constant scale saves no state)
    out[(2, False, "bfloat16", "float16")] = (out[(2, False, "bfloat16")][0],
                                              run("float16", 2, False, ckpt_in=f"{root}/bfloat16_tp2_zero1False"))
    return out


def test_a_run_resumed_in_another_precision_goes_on_from_its_saved_weights(tmp_path):
    """fp32 -> bf16: the mains kept the weights they were built with (a resume went back to step 0's weights at its
    first step, the optimizer state kept; TP=2, plain optimizer), or took the saved fp32 weights rounded to bf16
    (ZeRO-1); now the mains are the saved fp32 parameters, the bf16 parameters their copy. bf16 -> fp32: the
    parameters are the saved fp32 mains, not the bf16 parameters widened (under ZeRO-1 gathered from the mains)."""
    for r in run_distributed(_precision_worker, 2, str(tmp_path), timeout=600):
        for (tp, zero1, first, *second), (saved, resumed) in r.items():
            where = f"tp{tp} zero1={zero1}, {first} -> {second or 'the other'}"
            assert torch.equal(resumed["main"], saved["main"]), (where, (resumed["main"] - saved["main"]).abs().max())
            if second:
                assert torch.equal(resumed["param"], saved["main"].half().float()), where
            elif first == "float32":  # the 16-bit parameters: the mains rounded
                assert torch.equal(resumed["param"], saved["main"].bfloat16().float()), where
            else:
                assert torch.equal(resumed["param"], saved["main"]), where
