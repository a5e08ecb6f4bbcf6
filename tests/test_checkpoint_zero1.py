"""ZeRO-1 checkpoints from the shards: a run hops DP=4 -> 2 -> 1 -> 4 (TP 1 -> 2 -> 2 x PP 2 -> 1) through
checkpoints and follows the straight run (written with overlap_param_gather); ZeRO-1 and non-distributed
checkpoints are interchangeable; no rank ever gathers the full optimizer state."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import TINY_MODEL, LossRecorder, make_trainer, synthetic_datamodule

WORLD, GLOBAL_BATCH, MICRO = 4, 8, 2


def _run(tp: int, zero1: bool, max_steps: int, *, pp: int = 1, ckpt_in: str | None = None, save_to: str | None = None,
         every: str | None = None, overlap_param_gather: bool = False) -> list[float]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    strategy = MegatronStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                overlap_param_gather=overlap_param_gather)
    recorder = LossRecorder()
    callbacks = [MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.05, use_distributed_optimizer=zero1)), recorder]
    if every:
        callbacks.append(ModelCheckpoint(dirpath=every, filename="{step}", every_n_train_steps=3, save_top_k=-1))
    trainer = make_trainer(strategy, WORLD, max_steps, callbacks=callbacks, enable_checkpointing=bool(every))
    dims = strategy.parallel_dims.for_world_size(trainer.world_size)
    dp_rank = dims.coordinates(torch.distributed.get_rank())["dp"]
    dm = synthetic_datamodule(GLOBAL_BATCH, MICRO, dims.dp, dp_rank)
    trainer.fit(BertLightningModule(**TINY_MODEL), datamodule=dm, ckpt_path=ckpt_in)
    if save_to:
        trainer.save_checkpoint(save_to)
    if (type(trainer.strategy.optimizers[0]).__name__ == "DistributedOptimizer") != zero1:
        raise AssertionError(f"zero1={zero1} built {type(trainer.strategy.optimizers[0]).__name__}")
    return recorder.losses


def _worker(root: str) -> dict:
    # DistributedOptimizer.state_dict/load_state_dict raise: the sharded checkpoint never calls them.
    # DP=4, saves step=3; with the parameter all-gather overlapped, the checkpoint is written while the
    # gathers of step 3 are still pending (ModelCheckpoint saves before the next forward).
    out = {"straight": _run(1, True, 7, every=f"{root}/straight", overlap_param_gather=True)}
    a = f"{root}/straight/step=3.ckpt"
    out["dp2"] = _run(2, True, 4, ckpt_in=a, save_to=f"{root}/dp2")
    # DP=1 as TP=2 x PP=2: two steps, so the last stage's tied embedding state is checked too
    out["dp1"] = _run(2, True, 6, pp=2, ckpt_in=f"{root}/dp2", save_to=f"{root}/dp1")
    out["dp4"] = _run(1, True, 7, ckpt_in=f"{root}/dp1")
    out["plain_from_zero1"] = _run(2, False, 4, ckpt_in=a, save_to=f"{root}/plain")
    out["zero1_from_plain"] = _run(1, True, 6, ckpt_in=f"{root}/plain")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_worker, WORLD, str(tmp_path_factory.mktemp("zero1ckpt")), timeout=900)[-1]  # a last stage


def _close(got: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


def test_zero1_reshards_dp4_dp2_dp1_and_back(runs):
    straight = runs["straight"]
    assert len(straight) == 7
    _close(runs["dp2"], straight[3:4])
    _close(runs["dp1"], straight[4:6])
    _close(runs["dp4"], straight[6:7])


def test_zero1_and_plain_checkpoints_are_interchangeable(runs):
    straight = runs["straight"]
    _close(runs["plain_from_zero1"], straight[3:4])
    _close(runs["zero1_from_plain"], straight[4:6])
