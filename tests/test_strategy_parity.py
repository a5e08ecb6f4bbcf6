"""MegatronStrategy under Trainer.fit: TP, DP and TP x DP equal one process (fp32, dropout off)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import TINY_MODEL, LossRecorder, dataloader, full_params, local_shards, make_trainer

GLOBAL_BATCH, MICRO = 8, 2


class BertInit:
    """The initial parameters of TINY_MODEL (layout-independent by construction)."""

    @staticmethod
    def params() -> dict:
        from lightning_megatron.models.bert.module import BertLightningModule

        module = BertLightningModule(**TINY_MODEL)
        module.configure_model()
        return full_params([{"shards": local_shards(module), "tp_rank": 0, "dp_rank": 0}], 1)
STEPS = 10


def _fit_worker(tp: int, pp: int, vp: int | None, world: int, steps: int, extra: dict | None = None) -> dict:
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    strategy = MegatronStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vp, micro_batch_size=MICRO,
                                **(extra or {}))
    module = BertLightningModule(**TINY_MODEL)
    recorder = LossRecorder()
    recorder.shm = None

    def record_paths(trainer, pl_module) -> None:  # which TP/DP groups run on shared memory during fit
        from lightning_megatron.cpu.shared_memory import SharedMemoryCollectives
        from lightning_megatron.tensor_parallel.communicator import communicator_of

        ps = strategy.parallel_state
        recorder.shm = {name: isinstance(communicator_of(g), SharedMemoryCollectives)
                        for name, g in (("tp", ps.tp_group), ("dp", ps.dp_group)) if g is not None and g.size() > 1}

    recorder.on_train_start = record_paths
    trainer = make_trainer(strategy, world, steps, callbacks=[recorder])
    dp = world // (tp * pp)
    ps_layout = strategy.layout
    dp_rank = ps_layout.coordinates(torch.distributed.get_rank())[1]
    trainer.fit(module, train_dataloaders=dataloader(GLOBAL_BATCH // dp, dp, dp_rank))
    ps = strategy.parallel_state
    return {"losses": recorder.losses, "shards": local_shards(module), "tp_rank": ps.tp_rank, "dp_rank": ps.dp_rank,
            "pp_rank": ps.pp_rank, "shm": recorder.shm}


def _manual_worker(steps: int) -> dict:
    """The ground truth without Lightning: a plain PyTorch loop over the same microbatches."""
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.tensor_parallel import model_parallel_seed

    model_parallel_seed(1234, 0)
    module = BertLightningModule(**TINY_MODEL)
    module.configure_model()
    optimizer = module.configure_optimizers()
    chunk = module.model_chunks[0]
    losses = []
    batches = iter(dataloader(GLOBAL_BATCH, 1, 0))
    for _ in range(steps):
        batch = next(batches)
        n = GLOBAL_BATCH // MICRO
        step_loss = 0.0
        for i in range(n):
            micro = {k: v[i * MICRO:(i + 1) * MICRO] for k, v in batch.items()}
            loss, _ = module.forward_step(micro, chunk)
            (loss / n).backward()
            step_loss += loss.item() / n
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return {"losses": losses, "shards": local_shards(module), "tp_rank": 0, "dp_rank": 0, "pp_rank": 0}


@pytest.fixture(scope="module")
def reference():
    [r] = run_distributed(_fit_worker, 1, 1, 1, None, 1, STEPS, timeout=300)
    return r["losses"], full_params([r], 1)


def test_one_process_strategy_equals_plain_pytorch_loop(reference):
    """The single-process reference itself equals a hand-written loop: Lightning adds nothing, loses nothing."""
    [manual] = run_distributed(_manual_worker, 1, STEPS, timeout=300)
    ref_losses, ref_params = reference
    torch.testing.assert_close(torch.tensor(ref_losses), torch.tensor(manual["losses"]), rtol=1e-6, atol=0)
    params = full_params([manual], 1)
    moved = 0
    for name, value in ref_params.items():
        # 1e-5: the key bias has a zero true gradient (softmax is shift-invariant), so its Adam updates
        # are normalized rounding noise whose summation order differs between the two programs.
        torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # Training really moved the weights (a loop that never applies gradients would also "match").
    init = BertInit.params()
    matrices = [n for n in ref_params if ref_params[n].dim() == 2]
    moved = [n for n in matrices if (init[n] - ref_params[n]).abs().max() > 1e-3]
    assert len(moved) == len(matrices), f"only {len(moved)}/{len(matrices)} weight matrices changed"


def _compare(results, tp, reference):
    ref_losses, ref_params = reference
    last = [r for r in results if r["losses"]]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    params = full_params(results, tp)
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-5, atol=1e-5, msg=name)
    assert last


def _fit_many(layouts: list[tuple[int, int, int | None]], world: int, steps: int,
              extra: dict | None = None) -> list[dict]:
    # Several Trainer.fit runs in the same ranks: process start-up and imports are paid once.
    return [_fit_worker(tp, pp, vp, world, steps, extra) for tp, pp, vp in layouts]


def _layout_id(layout, world):
    tp, pp, vp = layout
    return f"tp{tp}-pp{pp}" + (f"-vp{vp}" if vp else "") + f"-dp{world // (tp * pp)}"


@pytest.mark.parametrize("world,layouts", [
    (2, [(2, 1, None), (1, 1, None), (1, 2, None), (1, 2, 2)]),
    (4, [(2, 1, None), (1, 4, None), (2, 2, None), (1, 2, None)]),
], ids=["world2", "world4"])
def test_layouts_equal_one_process(world, layouts, reference):
    """TP, DP, PP (1F1B), PP x VP (interleaved) and mixes: per-step loss over 10 steps within 1e-5
    relative and final parameters within 1e-5 of one process with the same global batch."""
    ref_losses, _ = reference
    assert ref_losses[-1] < ref_losses[0] - 0.05, "the reference run must learn"
    # with the CPU tuning switched on explicitly (as the CPU recipe does)
    per_rank = run_distributed(_fit_many, world, layouts, world, STEPS, {"cpu_tuning": True}, timeout=600)
    for i, layout in enumerate(layouts):
        results = [r[i] for r in per_rank]
        # with the CPU tuning every TP and DP group of more than one rank uses the shared-memory path
        assert all(all(r["shm"].values()) for r in results), (layout, [r["shm"] for r in results])
        assert any(r["shm"] for r in results) == (layout[0] > 1 or world // (layout[0] * layout[1]) > 1)
        try:
            _compare(results, layout[0], reference)
        except AssertionError as e:
            raise AssertionError(f"layout {_layout_id(layout, world)}: {e}") from e


def test_gloo_collectives_equal_one_process(reference):
    """The same TP=2 and DP=2 runs with the library's defaults: no CPU tuning, torch.distributed's
    collectives (the path every device takes)."""
    layouts = [(2, 1, None), (1, 1, None)]
    per_rank = run_distributed(_fit_many, 2, layouts, 2, STEPS, timeout=600)
    for i, layout in enumerate(layouts):
        assert [r[i]["shm"] for r in per_rank] == [{"tp": False} if layout[0] > 1 else {"dp": False}] * 2
        try:
            _compare([r[i] for r in per_rank], layout[0], reference)
        except AssertionError as e:
            raise AssertionError(f"layout {_layout_id(layout, 2)} on gloo: {e}") from e
