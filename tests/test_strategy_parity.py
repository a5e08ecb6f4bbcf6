"""MegatronStrategy under Trainer.fit: TP, DP, PP and mixes equal one process (fp32, dropout off), through
``lightning_megatron.check.check_layouts``, the same function as ``lightning-megatron check``."""

from __future__ import annotations

import functools

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import (TINY_MODEL, SyntheticBertDataset, assert_final_params_close, dataloader, full_params,
                              local_shards)

from lightning_megatron.parallel_dims import ParallelDims

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


def make_module():
    from lightning_megatron.models.bert.module import BertLightningModule

    return BertLightningModule(**TINY_MODEL)


def check(layouts: list[str], reference_run=None, **kwargs):
    """The one parity mechanism (``lightning-megatron check``): 10 steps of TINY_MODEL on the same
    global batches, per-step loss and grad norm, every gradient after step 1, final parameters."""
    from lightning_megatron.check import check_layouts

    return check_layouts(make_module, functools.partial(SyntheticBertDataset, 512), layouts=layouts,
                         global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO, steps=STEPS, record_params=True,
                         reference_run=reference_run, timeout=600, **kwargs)


def _manual_worker(steps: int) -> dict:
    """The ground truth without Lightning: a plain PyTorch loop over the same microbatches (on gloo and the
    host, as the reference: ``check_layouts`` runs its layouts on CPU whatever the test device)."""
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
    return check([]).reference


def test_one_process_strategy_equals_plain_pytorch_loop(reference):
    """The single-process reference itself equals a hand-written loop: Lightning adds nothing, loses nothing."""
    [manual] = run_distributed(_manual_worker, 1, STEPS, timeout=300, backend="gloo")
    ref_losses, ref_params = reference.losses, reference.params
    torch.testing.assert_close(torch.tensor(ref_losses), torch.tensor(manual["losses"]), rtol=1e-6, atol=0)
    # Relative to the update: the key bias has a zero true gradient (softmax is shift-invariant), so its
    # Adam updates are normalized rounding noise whose summation order differs between the two programs.
    init = BertInit.params()
    assert all(torch.equal(reference.init_params[n], init[n]) for n in init) and init.keys() == ref_params.keys()
    assert_final_params_close(full_params([manual], 1), ref_params, init)
    # Training really moved the weights (a loop that never applies gradients would also "match").
    matrices = [n for n in ref_params if ref_params[n].dim() == 2]
    moved = [n for n in matrices if (init[n] - ref_params[n]).abs().max() > 1e-3]
    assert len(moved) == len(matrices), f"only {len(moved)}/{len(matrices)} weight matrices changed"


@pytest.mark.parametrize("world,layouts", [
    (2, ["tp2", "dp2", "pp2", "pp2vp2"]),
    (4, ["tp2dp2", "pp4", "tp2pp2", "pp2dp2"]),
], ids=["world2", "world4"])
def test_layouts_equal_one_process(world, layouts, reference):
    """TP, DP, PP (1F1B), PP x VP (interleaved) and mixes: per-step loss over 10 steps within 1e-5
    relative, grad norms within 1e-5, every gradient after step 1 within 1e-4 of its largest entry,
    and final parameters within 2e-3 of the update (rms per tensor, ``check.parity.update_error``) of
    one process with the same global batch."""
    assert reference.losses[-1] < reference.losses[0] - 0.05, "the reference run must learn"
    # with the CPU tuning switched on explicitly (as the CPU recipe does)
    report = check(layouts, reference, strategy_kwargs={"cpu_tuning": True})
    print(report.table())
    assert report.passed, report.table()
    assert [r.layout for r in report.results] == layouts
    for name in layouts:
        run = report.runs[name]
        assert len(run.memory) == world
        layout = ParallelDims.parse(name)
        # with the CPU tuning every TP and DP group of more than one rank uses the shared-memory path
        assert all(all(c.values()) for c in run.collectives), (name, run.collectives)
        assert any(run.collectives) == (layout.tp > 1 or layout.dp > 1), (name, run.collectives)
        # the modules in the model's forward order across stages and chunks (what names the first
        # divergence when a pipelined layout is the reference)
        assert run.output_order == report.reference.output_order, (name, run.output_order)


def test_gloo_collectives_equal_one_process(reference):
    """The same TP=2 and DP=2 runs with the library's defaults: no CPU tuning, torch.distributed's
    collectives (the path every device takes)."""
    report = check(["tp2", "dp2"], reference)
    assert report.passed, report.table()
    assert report.runs["tp2"].collectives == [{"tp": False}] * 2
    assert report.runs["dp2"].collectives == [{"dp": False}] * 2
