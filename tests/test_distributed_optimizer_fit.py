"""The distributed optimizer (ZeRO-1) through Trainer.fit equals the non-distributed one, with its
parameter all-gather overlapped with the next forward too (bitwise equal to not overlapped), and a run
resumes after a data-parallel size change."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import TINY_CONFIG, TINY_OPTIONS, assert_final_params_close, make_trainer, synthetic_datamodule

from lightning_megatron.check import Tolerances

GLOBAL_BATCH, MICRO = 8, 2
VAL = dict(limit_val_batches=1, val_check_interval=5)
"""A validation (forward only) after steps 5 and 10: with overlap, while the gathers are pending."""


def _recorder():
    from lightning.pytorch import Callback

    class Recorder(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.norms: list[float] = []
            self.main_grads_in_buffer: list[bool] = []
            self.val_losses: list[float] = []

        def on_train_start(self, trainer, pl_module) -> None:
            self.init = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            self.buckets = len(trainer.strategy.grad_buffer.buckets)

        def on_validation_end(self, trainer, pl_module) -> None:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            opt = trainer.strategy.optimizers[0]
            self.losses.append(float(outputs["loss"]))
            self.norms.append(float(opt.last_grad_norm))
            buf = getattr(opt, "grad_buffer", None)
            if buf is not None:  # the fp32 grads must exist once: main_grad is a view of the buffer
                lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
                self.main_grads_in_buffer.append(all(lo <= p.main_grad.data_ptr() < hi
                                                     for p in pl_module.parameters() if p.requires_grad))

    return Recorder()


def _run(tp: int, dtype: str, distributed: bool, max_steps: int, *, save_to: str | None = None,
         ckpt_in: str | None = None, clip_grad: float = 0.05, overlap_param_gather: bool = False,
         **trainer_kwargs) -> dict:
    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    # Small buckets (the tiny model has ~50k params): several all-gathers in flight with overlap.
    strategy = MegatronStrategy(tensor_model_parallel_size=tp, ddp_bucket_size_mb=0.05,
                                overlap_param_gather=overlap_param_gather)
    recorder = _recorder()
    callback = MegatronOptimizerCallback(OptimizerConfig(clip_grad=clip_grad, use_distributed_optimizer=distributed))
    trainer = make_trainer(strategy, 4, max_steps, callbacks=[callback, recorder],
                           precision="bf16-true" if dtype == "bfloat16" else "32-true", **trainer_kwargs)
    dims = strategy.parallel_dims.for_world_size(trainer.world_size)
    dp_rank = dims.coordinates(torch.distributed.get_rank())["dp"]
    dm = synthetic_datamodule(GLOBAL_BATCH, MICRO, dims.dp, dp_rank)
    module = BertLightningModule(BertConfig(**TINY_CONFIG, params_dtype=dtype), **TINY_OPTIONS)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_in)
    if save_to:
        trainer.save_checkpoint(save_to)
    opt = trainer.strategy.optimizers[0]
    return {"losses": recorder.losses, "norms": recorder.norms, "type": type(opt).__name__,
            "main_grads_in_buffer": recorder.main_grads_in_buffer,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()}, "init": recorder.init,
            "val_losses": recorder.val_losses,
            # ZeRO-1's flat main params per group and the buckets (the buffer ordered by group within each)
            "runs": [len(g["params"]) for g in opt.optimizer.param_groups],
            "buckets": recorder.buckets}


def _worker(root: str) -> dict:
    out = {}
    # bf16 without clipping: the clipping coefficient comes from a norm summed in another order
    # (per shard vs per parameter), and a last-bit change of an fp32 main param can flip the
    # rounding of its bf16 copy. Without clipping the two optimizers are bit-identical.
    for dtype, clip in (("float32", 0.05), ("bfloat16", 0.0)):
        out[f"plain_{dtype}"] = _run(2, dtype, False, 10, clip_grad=clip)
        out[f"zero1_{dtype}"] = _run(2, dtype, True, 10, clip_grad=clip, **(VAL if dtype == "bfloat16" else {}))
    # Overlapped parameter all-gather in bf16 (the gather in the params' dtype; fp32 is run overlapped
    # by tests/test_checkpoint_zero1.py and tests/test_optimizer_grad_norm.py)
    out["overlap_bfloat16"] = _run(2, "bfloat16", True, 10, clip_grad=0.0, overlap_param_gather=True, **VAL)
    # The 16-bit wrapper's flat state through a checkpoint: saved by it, loaded by ZeRO-1 (sharded over DP=2: a
    # parameter's state read from the wrong place of its run would show) and by itself.
    out["first_bfloat16"] = _run(2, "bfloat16", False, 5, clip_grad=0.0, save_to=f"{root}/plain_bf16")
    out["zero1_from_plain_bfloat16"] = _run(2, "bfloat16", True, 10, clip_grad=0.0, ckpt_in=f"{root}/plain_bf16")
    out["plain_from_plain_bfloat16"] = _run(2, "bfloat16", False, 10, clip_grad=0.0, ckpt_in=f"{root}/plain_bf16")
    out["first"] = _run(2, "float32", True, 5, save_to=f"{root}/zero1")
    out["resumed_dp4"] = _run(1, "float32", True, 10, ckpt_in=f"{root}/zero1")
    try:  # last: nothing to overlap without the DistributedOptimizer, refused before the first step
        _run(2, "float32", False, 1, overlap_param_gather=True)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero1")
    return run_distributed(_worker, 4, str(root), timeout=600)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_distributed_optimizer_equals_non_distributed_tp2_dp2(runs, dtype):
    plain, zero1 = runs[f"plain_{dtype}"], runs[f"zero1_{dtype}"]
    assert zero1["type"] == "DistributedOptimizer"
    assert plain["type"] != "DistributedOptimizer"
    assert len(zero1["main_grads_in_buffer"]) == 10 and all(zero1["main_grads_in_buffer"])
    # one flat run per weight-decay group and bucket: its fused step sees a few tensors, not one per parameter;
    # the 16-bit non-distributed wrapper's too (its main params views of one flat buffer)
    assert zero1["buckets"] > 1 and len(zero1["runs"]) == 2 and all(n <= zero1["buckets"] for n in zero1["runs"])
    if dtype == "bfloat16":
        assert plain["buckets"] > 1 and len(plain["runs"]) == 2 and all(n <= plain["buckets"] for n in plain["runs"])
    torch.testing.assert_close(torch.tensor(zero1["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=0)
    if dtype == "float32":  # clip_grad=0.05 clips on every step: the clipping norm must be the same number
        assert min(plain["norms"]) > 0.05
    torch.testing.assert_close(torch.tensor(zero1["norms"]), torch.tensor(plain["norms"]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_overlap_param_gather_bitwise_equal_to_off_tp2_dp2(runs, dtype):
    plain, zero1, overlap = runs[f"plain_{dtype}"], runs[f"zero1_{dtype}"], runs[f"overlap_{dtype}"]
    assert overlap["type"] == "DistributedOptimizer"
    # Against the non-distributed reference (as above), then bit for bit against ZeRO-1 without overlap:
    # the same collectives on the same bytes, only waited for later.
    torch.testing.assert_close(torch.tensor(overlap["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=0)
    assert overlap["losses"] == zero1["losses"]
    assert overlap["norms"] == zero1["norms"]
    # The final params (after fit: every gather waited for): ZeRO-1's bit for bit, the plain run's closely
    # (relative to the update, the suite's one rule: megatron_testing.assert_final_params_close).
    assert overlap["params"].keys() == zero1["params"].keys() == plain["params"].keys() != set()
    assert all(torch.equal(overlap["params"][n], zero1["params"][n]) for n in plain["params"])
    assert all(torch.equal(plain["init"][n], overlap["init"][n]) for n in plain["init"])
    assert_final_params_close(overlap["params"], plain["params"], plain["init"],
                              rtol=None if dtype == "float32" else Tolerances.bf16().param_rtol)
    assert len(overlap["val_losses"]) == 2 and overlap["val_losses"] == zero1["val_losses"]


def test_overlap_param_gather_without_distributed_optimizer_is_refused(runs):
    assert runs["refused"] is not None and "overlap_param_gather=True" in runs["refused"]
    assert "use_distributed_optimizer=True" in runs["refused"]


def test_the_16_bit_wrappers_flat_state_resumes_under_both_optimizers(runs):
    straight = runs["plain_bfloat16"]["losses"]
    assert runs["first_bfloat16"]["losses"] == straight[:5]
    for resumed in ("zero1_from_plain_bfloat16", "plain_from_plain_bfloat16"):
        torch.testing.assert_close(torch.tensor(runs[resumed]["losses"]), torch.tensor(straight[5:]), rtol=1e-6, atol=0)


def test_resume_after_data_parallel_size_change(runs):
    straight = runs["zero1_float32"]["losses"]
    assert runs["first"]["losses"] == pytest.approx(straight[:5], rel=1e-6)
    # Saved at TP=2 x DP=2 with the optimizer state sharded over 2 ranks, resumed at TP=1 x DP=4.
    torch.testing.assert_close(torch.tensor(runs["resumed_dp4"]["losses"]), torch.tensor(straight[5:]),
                               rtol=1e-5, atol=0)
