"""Bad configurations raise a ValueError that names the numbers, before any training step."""

from __future__ import annotations

from dist_utils import run_distributed
from megatron_testing import TINY_CONFIG, TINY_OPTIONS, make_trainer, synthetic_datamodule


def _attempt(strategy_kwargs: dict, config_fields: dict, trainer_kwargs: dict, global_batch: int = 8,
             micro: int = 2, dp: int = 1) -> str:
    from lightning.pytorch import Callback

    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    class CountSteps(Callback):
        steps = 0

        def on_train_batch_start(self, *args) -> None:
            CountSteps.steps += 1

    try:
        strategy = MegatronStrategy(**strategy_kwargs)
        trainer = make_trainer(strategy, 2, 3, callbacks=[CountSteps()], **trainer_kwargs)
        trainer.fit(BertLightningModule(BertConfig(**{**TINY_CONFIG, **config_fields}), **TINY_OPTIONS),
                    datamodule=synthetic_datamodule(global_batch, micro, dp, 0))
    except ValueError as e:
        assert CountSteps.steps == 0, "the error must come before any training step"
        return str(e)
    return "no error"


def _errors_worker() -> dict:
    return {
        "world": _attempt({"tensor_model_parallel_size": 4}, {}, {}),
        "heads": _attempt({"tensor_model_parallel_size": 2}, {"num_attention_heads": 3, "hidden_size": 30,
                                                              "ffn_hidden_size": 60}, {}),
        "batch": _attempt({"tensor_model_parallel_size": 1}, {}, {}, global_batch=6, micro=2, dp=2),
        "accumulate": _attempt({"tensor_model_parallel_size": 2}, {}, {"accumulate_grad_batches": 2}),
        "clip": _attempt({"tensor_model_parallel_size": 2}, {}, {"gradient_clip_val": 1.0}),
        "microbatches": _attempt({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                                  "virtual_pipeline_model_parallel_size": 2}, {"num_layers": 4}, {},
                                 global_batch=6, micro=2),
        # the layout is the strategy's: a config record that says otherwise is refused, naming where to set it
        "layout": _attempt({"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 1}, {}),
    }


def test_bad_configurations_raise_before_training():
    e = run_distributed(_errors_worker, 2, timeout=300)[0]
    assert "world_size=2 is not divisible by tensor_model_parallel_size=4" in e["world"], e["world"]
    assert "num_attention_heads" in e["heads"] and "tensor_model_parallel_size" in e["heads"], e["heads"]
    assert "global_batch_size=6 is not divisible by micro_batch_size=2 x data-parallel size=2" in e["batch"], e["batch"]
    assert "accumulate_grad_batches=2" in e["accumulate"], e["accumulate"]
    assert "MegatronOptimizerCallback" in e["clip"], e["clip"]
    assert "3" in e["microbatches"] and "pipeline" in e["microbatches"].lower(), e["microbatches"]
    assert ("config.tensor_model_parallel_size=1 but the strategy runs tensor_model_parallel_size=2" in e["layout"]
            and "MegatronStrategy(tensor_model_parallel_size=...)" in e["layout"]), e["layout"]


def test_optimizers_that_do_not_fit_the_strategy_are_refused():
    """A ZeRO-1 optimizer over a grad buffer other than the strategy's, and overlap_param_gather with no
    ZeRO-1 optimizer, are refused naming the fix (``setup_checks.check_optimizers``, run after
    ``configure_optimizers``); a ZeRO-1 optimizer over the strategy's buffer passes."""
    from types import SimpleNamespace

    import pytest
    import torch

    from lightning_megatron.protocols import PlainOptimizer
    from lightning_megatron.setup_checks import check_optimizers

    ours, theirs = object(), object()
    sharded = SimpleNamespace(reduces_gradients=True, buffer=theirs)  # what is_sharded and the check read
    with pytest.raises(ValueError, match=r"must shard the strategy's grad buffer.*grad_buffer=trainer.strategy"):
        check_optimizers([sharded], ours, overlap_param_gather=False)
    check_optimizers([SimpleNamespace(reduces_gradients=True, buffer=ours)], ours, overlap_param_gather=True)
    plain = PlainOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    with pytest.raises(ValueError, match=r"overlap_param_gather=True\).*use_distributed_optimizer true"):
        check_optimizers([plain], ours, overlap_param_gather=True)
    check_optimizers([plain], ours, overlap_param_gather=False)


def test_trainer_options_the_schedule_replaces_are_refused_before_the_ranks_start(monkeypatch):
    """From Python (``Trainer(devices=2, strategy=MegatronStrategy(...))`` in a script), accumulate_grad_batches and
    gradient_clip_val were refused at set-up, once the ranks had started: the error once a rank, then gloo's
    "Connection closed by peer". The launcher refuses them before it starts any rank (starting one here would
    fail the test, not re-run it)."""
    import pytest
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_megatron.strategy import MegatronStrategy, _PrewarmedLauncher

    def started(self) -> None:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(_PrewarmedLauncher, "_call_children_scripts", started)
    for option, message in (({"accumulate_grad_batches": 2}, "accumulate_grad_batches=2"),
                            ({"gradient_clip_val": 1.0}, "gradient_clip_val")):
        trainer = Trainer(accelerator="cpu", devices=2, strategy=MegatronStrategy(), logger=False, max_steps=1,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **option)
        assert isinstance(trainer.strategy.launcher, _PrewarmedLauncher)
        with pytest.raises(ValueError, match=message):
            trainer.fit(BoringModel())

    # ... and so is a module the contract cannot run: a plain one under pipelining, or one implementing part of it
    # (the methods: its model_chunks come from configure_model, which runs in each rank)
    class Partial(BoringModel):
        def forward_step(self, microbatch, chunk):
            raise AssertionError("refused before any step")

    for strategy, module, why in ((MegatronStrategy(pipeline_model_parallel_size=2), BoringModel(),
                                   "pipeline_model_parallel_size > 1 needs it"),
                                  (MegatronStrategy(), Partial(), "it implements part of it")):
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, max_steps=1,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with pytest.raises(TypeError, match=f"does not implement the MegatronModule contract \\({why}\\)"):
            trainer.fit(module)
