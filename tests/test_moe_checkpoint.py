"""Checkpoints of a mixture of experts reshard across expert-parallel sizes.

The Mixtral shape of ``test_gpt_parallel`` trains 2 steps at EP=2 (2 processes, each holding 2 of the 4
experts of every layer) and saves; one process then resumes that checkpoint at EP=1 (all 4 experts)
and trains a third step. Its third loss and its final parameters equal a straight one-process run of
3 steps: the experts were saved under their global indices and the Adam state of each followed it.
"""

from __future__ import annotations

import torch

from dist_utils import run_distributed
from megatron_testing import LossRecorder, assert_final_params_close, make_trainer
from test_gpt_parallel import MOE_TINY, SyntheticGPTDataset, make_module

GLOBAL_BATCH, MICRO, STEPS = 8, 2, 3


def _datamodule(dp_size: int, dp_rank: int):
    from lightning.pytorch import LightningDataModule

    from lightning_megatron.data.loader import MegatronDataLoader
    from lightning_megatron.data.samplers import MegatronPretrainingSampler

    class _DM(LightningDataModule):
        micro_batch_size, global_batch_size = MICRO, GLOBAL_BATCH

        def train_dataloader(self):
            sampler = MegatronPretrainingSampler(
                total_samples=GLOBAL_BATCH * STEPS, consumed_samples=self.trainer.global_step * GLOBAL_BATCH,
                micro_batch_size=MICRO, data_parallel_rank=dp_rank, data_parallel_size=dp_size,
                num_microbatches=GLOBAL_BATCH // dp_size // MICRO)
            return MegatronDataLoader(SyntheticGPTDataset(GLOBAL_BATCH * STEPS), batch_sampler=sampler)

    return _DM()


def _fit(ep: int, steps: int, ckpt_in: str | None = None, save_to: str | None = None) -> dict:
    import torch.distributed as dist

    from lightning_megatron.strategy import MegatronStrategy

    strategy = MegatronStrategy(expert_model_parallel_size=ep, micro_batch_size=MICRO)
    module = make_module(**MOE_TINY)
    recorder = LossRecorder()
    world = dist.get_world_size() if dist.is_initialized() else 1
    trainer = make_trainer(strategy, world, steps, callbacks=[recorder])
    dims = strategy.parallel_dims.for_world_size(world)
    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer.fit(module, datamodule=_datamodule(dims.dp, dims.coordinates(rank)["dp"]), ckpt_path=ckpt_in)
    if save_to:
        trainer.save_checkpoint(save_to)
    params = {n: p.detach().clone() for n, p in module.sharded_named_parameters()}
    return {"losses": recorder.losses, "params": params}


def _at_ep2(path: str) -> dict:
    return _fit(2, 2, save_to=path)


def _at_ep1(path: str) -> dict:
    straight = _fit(1, STEPS)
    resumed = _fit(1, STEPS, ckpt_in=path)
    init = make_module(**MOE_TINY)
    init.configure_model()
    return {"straight": straight, "resumed": resumed,
            "init": {n: p.detach().clone() for n, p in init.sharded_named_parameters()}}


def test_checkpoint_saved_at_ep2_resumes_at_ep1(tmp_path):
    path = str(tmp_path / "ep2.ckpt")
    ep2 = run_distributed(_at_ep2, 2, path, timeout=300)
    # each EP rank holds half of the experts under their global indices
    experts = [{n.split("local_experts.")[1].split(".")[0] for n in r["params"] if "local_experts" in n} for r in ep2]
    assert experts == [{"0", "1"}, {"2", "3"}], experts
    [one] = run_distributed(_at_ep1, 1, path, timeout=300)
    straight, resumed = one["straight"], one["resumed"]
    assert len(straight["losses"]) == STEPS and len(resumed["losses"]) == 1  # the third step only
    torch.testing.assert_close(ep2[0]["losses"], straight["losses"][:2], rtol=1e-5, atol=0)
    torch.testing.assert_close(resumed["losses"][0], straight["losses"][2], rtol=1e-5, atol=0)
    assert_final_params_close(resumed["params"], straight["params"], one["init"])
