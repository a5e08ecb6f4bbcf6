"""Through Trainer.fit: one exact gradient norm for every layout and optimizer, overlapped gradient
reduction bitwise equal to reduction after backward, and one fp32 copy of the gradients."""

from __future__ import annotations

import re

import pytest
import torch

import gpipe_schedule  # noqa: F401  (a user's schedule, registered as "gpipe" by the import)
from dist_utils import run_distributed
from megatron_testing import TINY_CONFIG, TINY_OPTIONS, make_trainer, synthetic_datamodule

GLOBAL_BATCH, MICRO, STEPS = 8, 2, 4


def _recorder():
    from lightning.pytorch import Callback

    class Recorder(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.norms: list[float] = []
            self.one_copy: list[bool] = []
            self.bytes: tuple[int, int] | None = None
            self.loss_func_means: list[dict[str, float] | None] = []
            self.logged: list[dict[str, float]] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            # After finalize_model_grads: every fp32 grad is a view of the one buffer.
            buffer = trainer.strategy.grad_buffer
            params = [p for p in pl_module.parameters() if p.requires_grad]
            mains = [getattr(p, "main_param", None) for p in params]
            self.one_copy.append(buffer.reduced
                                 and all(buffer.holds(p.main_grad) and p.main_grad.dtype == torch.float32
                                         for p in params)
                                 and all(p.grad is None or buffer.holds(p.grad) for p in params)
                                 and all(m is None or m.grad is None or buffer.holds(m.grad) for m in mains))
            self.bytes = (buffer.memory_bytes(), 4 * sum(p.numel() for p in params))
            self.accumulate = buffer.accumulate.__name__
            self.norm_piece = buffer.norm_piece
            self.communicators = sorted(trainer.strategy.parallel_state.communicators)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            pl_module.loss_func_logs.clear()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))
            self.norms.append(float(trainer.strategy.optimizers[0].last_grad_norm))
            # What this rank logged, and (the last stage only) the mean of what its loss function returned
            own = pl_module.loss_func_logs
            self.loss_func_means.append({k: sum(d[k] for d in own) / len(own) for k in own[0]} if own else None)
            self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    return Recorder()


def _record_loss_func_logs(module) -> None:
    """``module.loss_func_logs``: the scalars each call of the loss function of this rank's ``forward_step``
    returned (the last pipeline stage's, before any reduction or broadcast)."""
    forward_step = module.forward_step
    module.loss_func_logs = []

    def recording_forward_step(microbatch, chunk):
        output, loss_func = forward_step(microbatch, chunk)
        if loss_func is None:
            return output, None

        def recording_loss_func(out):
            loss, logged = loss_func(out)
            module.loss_func_logs.append({k: float(v) for k, v in logged.items()
                                          if torch.is_tensor(v) and v.numel() == 1})
            return loss, logged

        return output, recording_loss_func

    module.forward_step = recording_forward_step


def _run(tp: int = 1, pp: int = 1, *, dtype: str = "float32", zero1: bool = False, clip_grad: float = 0.0,
         config_fields: dict | None = None, **strategy_kwargs) -> dict:
    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    strategy = MegatronStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **strategy_kwargs)
    recorder = _recorder()
    callback = MegatronOptimizerCallback(OptimizerConfig(clip_grad=clip_grad, use_distributed_optimizer=zero1))
    trainer = make_trainer(strategy, world, STEPS, callbacks=[callback, recorder],
                           precision="bf16-true" if dtype == "bfloat16" else "32-true")
    strategy.schedule_trace = []
    dims = strategy.parallel_dims.for_world_size(trainer.world_size)
    dp_rank = dims.coordinates(torch.distributed.get_rank() if world > 1 else 0)["dp"]
    dm = synthetic_datamodule(GLOBAL_BATCH, MICRO, dims.dp, dp_rank)
    module = BertLightningModule(BertConfig(**{**TINY_CONFIG, "params_dtype": dtype, **(config_fields or {})}),
                                 **TINY_OPTIONS)
    _record_loss_func_logs(module)
    trainer.fit(module, datamodule=dm)
    layers = {m.group(1) for name, _ in module.named_parameters() for m in [re.search(r"layers\.(\d+)\.", name)] if m}
    drained = strategy.weight_grads.drained  # the step's policy: which layers deferred their weight gradient
    row_grads = len(strategy.weight_grads.embedding_rows)
    return {"losses": recorder.losses, "norms": recorder.norms, "one_copy": recorder.one_copy,
            "bytes": recorder.bytes, "num_layers_here": len(layers), "pp_rank": module.parallel_state.pp_rank,
            "accumulate": recorder.accumulate, "norm_piece": recorder.norm_piece,
            "communicators": recorder.communicators, "drained": drained,
            "row_grads": row_grads, "loss_func_means": recorder.loss_func_means, "logged": recorder.logged,
            "first_backward": [e.kind for e in strategy.schedule_trace].index("B")}


def _two_ranks() -> dict:
    from lightning_megatron.cpu import CPUTuning

    return {
        "tp2": _run(tp=2),
        "pp2": _run(pp=2),
        # uneven stages (megatron-core's num_layers_in_last_pipeline_stage): 3 layers, then 1 + the heads
        "pp2_last1": _run(pp=2, config_fields={"num_layers_in_last_pipeline_stage": 1}),
        # a schedule the user registered in a file of its own (tests/gpipe_schedule.py): all forwards first
        "pp2_gpipe": _run(pp=2, pipeline_schedule="gpipe"),
        # the LM head's weight gradient computed at the pipeline flush (megatron-core's option)
        "pp2_deferred": _run(pp=2, config_fields={"defer_embedding_wgrad_compute": True}),
        # the CPU tuning's weight_grads_per_step: every linear layer's weight gradient once per step, at
        # the flush of the interleaved schedule (one GEMM over the step's microbatches)
        "pp2_vp2_step_wgrad": _run(pp=2, virtual_pipeline_model_parallel_size=2,
                                   cpu_tuning=CPUTuning(weight_grads_per_step=True)),
        "dp2": _run(),
        "dp2_zero1": _run(zero1=True),
        # the overlapped reduction, asynchronous on gloo (the default path; shared memory: tests/test_main_grads.py)
        "dp2_overlap_gloo": _run(overlap_grad_reduce=True),
        # bf16 with clipping on every step: ZeRO-1 must equal plain DP step for step
        "bf16_dp2": _run(dtype="bfloat16", clip_grad=0.05),
        "bf16_zero1": _run(dtype="bfloat16", clip_grad=0.05, zero1=True),
        # a bf16 pipeline (interleaved, overlapped p2p): the logged metrics are broadcast from the last
        # stage in fp32 while the precision plugin makes bf16 the default dtype (a bf16 receive buffer
        # aborted gloo)
        "bf16_pp2_vp2": _run(pp=2, dtype="bfloat16", clip_grad=0.05, virtual_pipeline_model_parallel_size=2),
        # ... with at most one microbatch waiting (wgrad_deferral_limit): the oldest computed in its turn
        "bf16_pp2_vp2_deferred": _run(pp=2, dtype="bfloat16", clip_grad=0.05, virtual_pipeline_model_parallel_size=2,
                                      config_fields={"defer_embedding_wgrad_compute": True,
                                                     "wgrad_deferral_limit": 1}),
    }


def _one_rank() -> dict:
    from lightning_megatron.cpu import CPUTuning

    one = _run()
    # without pipelining too: the weight gradients once per step, after the last of 4 microbatches
    one["step_wgrad"] = _run(cpu_tuning=CPUTuning(weight_grads_per_step=True))
    return one


@pytest.fixture(scope="module")
def runs():
    [one] = run_distributed(_one_rank, 1, timeout=300)
    two = run_distributed(_two_ranks, 2, timeout=600)
    return one, two


def test_grad_norm_of_every_layout_equals_one_process(runs):
    one, two = runs
    for rank in two:
        for name in ("tp2", "pp2", "pp2_last1", "pp2_gpipe", "pp2_vp2_step_wgrad", "dp2", "dp2_zero1"):
            norms = torch.tensor(rank[name]["norms"], dtype=torch.float64)
            ref = torch.tensor(one["norms"], dtype=torch.float64)
            # same parameters at step 1: the norm is the same number up to fp64 summation order
            assert abs(norms[0] - ref[0]) <= 1e-6 * ref[0], (name, norms[0].item(), ref[0].item())
            torch.testing.assert_close(norms, ref, rtol=1e-5, atol=0, msg=name)


def test_user_registered_schedule_trains_as_one_process(runs):
    """MegatronStrategy(pipeline_schedule="gpipe") runs the registered schedule (every one of the 4
    microbatches forward before the first backward, where 1F1B's stage 0 runs 2) and trains as one
    process (the grad norms: above); each chunk's backward passes in microbatch order, as 1F1B's: the
    same bits."""
    one, two = runs
    for rank in two:
        gpipe = rank["pp2_gpipe"]
        assert gpipe["first_backward"] == GLOBAL_BATCH // MICRO
        assert rank["pp2"]["first_backward"] == (2 if rank["pp2"]["pp_rank"] == 0 else 1)
        torch.testing.assert_close(torch.tensor(gpipe["losses"]), torch.tensor(one["losses"]), rtol=1e-6, atol=0)
        assert gpipe["losses"] == rank["pp2"]["losses"] and gpipe["norms"] == rank["pp2"]["norms"]


def test_uneven_pipeline_stages(runs):
    _, two = runs
    assert {r["pp2_last1"]["pp_rank"]: r["pp2_last1"]["num_layers_here"] for r in two} == {0: 3, 1: 1}
    assert {r["pp2"]["pp_rank"]: r["pp2"]["num_layers_here"] for r in two} == {0: 2, 1: 2}


def test_deferred_output_layer_weight_grad_is_bitwise_the_backward_one(runs):
    _, two = runs
    for rank in two:
        for deferred, base in (("pp2_deferred", "pp2"), ("bf16_pp2_vp2_deferred", "bf16_pp2_vp2")):
            assert rank[deferred]["losses"] == rank[base]["losses"], deferred
            assert rank[deferred]["norms"] == rank[base]["norms"], deferred
            # the last stage drained one weight gradient per microbatch and step; the first stage none
            expected = STEPS * GLOBAL_BATCH // MICRO if rank[deferred]["pp_rank"] == 1 else 0
            assert rank[deferred]["drained"] == expected, (deferred, rank[deferred]["drained"])
            assert rank[base]["drained"] == 0


def test_weight_grads_per_step_equal_one_process(runs):
    # fp32: one GEMM over the microbatches instead of their fp32 sum is a change of summation order only
    one, two = runs
    microbatch_grads = STEPS * GLOBAL_BATCH // MICRO  # per linear layer, over the run
    for run, linears in [(one["step_wgrad"], 4 * 4)] + [(r["pp2_vp2_step_wgrad"], 2 * 4 + r["pp2_vp2_step_wgrad"]["pp_rank"])
                                                         for r in two]:
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(one["losses"]), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(one["norms"]), rtol=1e-5, atol=0)
        # every linear layer's weight gradient went through the deferral: QKV, projection, FC1 and FC2
        # of each layer (4 layers; at PP=2 x VP=2 one per chunk), and the last stage's output layer,
        # which one process leaves to autograd (its weight is the word embedding's there)
        assert run["drained"] == microbatch_grads * linears, (run["pp_rank"], run["drained"])
    assert one["drained"] == 0


def test_overlapped_reduction_equals_reduction_after_backward(runs):
    _, two = runs
    for rank in two:
        base = rank["dp2"]
        for name in ("dp2_overlap_gloo",):
            assert rank[name]["losses"] == base["losses"], name  # bitwise: the same collectives
            assert rank[name]["norms"] == base["norms"], name


def test_bf16_zero1_equals_plain_data_parallel_with_clipping(runs):
    _, two = runs
    for rank in two:
        plain, zero1 = rank["bf16_dp2"], rank["bf16_zero1"]
        assert min(plain["norms"]) > 0.05  # clipping acts on every step
        assert zero1["losses"] == plain["losses"]
        torch.testing.assert_close(torch.tensor(zero1["norms"]), torch.tensor(plain["norms"]), rtol=1e-12, atol=0)


def test_bf16_pipelines_follow_bf16_data_parallel(runs):
    _, two = runs
    for rank in two:
        plain = torch.tensor(rank["bf16_dp2"]["losses"])
        for name in ("bf16_pp2_vp2",):  # another split of the same bf16 arithmetic: bf16 rounding apart
            assert len(rank[name]["losses"]) == STEPS
            torch.testing.assert_close(torch.tensor(rank[name]["losses"]), plain, rtol=2e-2, atol=0, msg=name)


@pytest.mark.parametrize("name", ["pp2", "pp2_last1", "pp2_deferred", "pp2_vp2_step_wgrad", "bf16_pp2_vp2",
                                  "bf16_pp2_vp2_deferred"])
def test_every_stage_logs_the_last_stages_metrics(runs, name):
    """Under pipelining only the last stage runs the loss function; every rank logs, at every step, the
    mean over the microbatches of what that loss function returned (every metric, not only the loss)."""
    _, two = runs
    [last] = [r[name] for r in two if r[name]["pp_rank"] == 1]
    assert all(r[name]["loss_func_means"] == [None] * STEPS for r in two if r[name]["pp_rank"] == 0)
    assert len(last["loss_func_means"]) == STEPS
    assert {"loss", "lm_loss", "mlm_accuracy"} <= set(last["loss_func_means"][0]), last["loss_func_means"][0]
    for rank, r in enumerate(two):
        for step, (logged, want) in enumerate(zip(r[name]["logged"], last["loss_func_means"])):
            got = {k: logged.get("loss" if k == "loss" else f"train_{k}") for k in want}
            assert got == pytest.approx(want, rel=1e-6), (rank, step, got, want)


def test_one_fp32_copy_of_the_gradients(runs):
    one, two = runs
    for run in [one] + [r[name] for r in two for name in r]:
        assert len(run["one_copy"]) == STEPS and all(run["one_copy"])
        buffer_bytes, param_bytes = run["bytes"]
        # 4 bytes per parameter, plus less than DP-size elements of padding per bucket (one bucket here)
        assert param_bytes <= buffer_bytes < param_bytes + 4 * 2


def _pp2_dp2() -> dict:
    # 1F1B with the tied embedding's deferred bucket: the default (overlapped reduce-scatter /
    # all-reduce on gloo) against the CPU tuning (shared memory, after backward), ZeRO-1 against
    # plain DP, clipping on.
    runs = {(zero1, mode): _run(pp=2, zero1=zero1, clip_grad=0.05, **kwargs)
            for zero1 in (False, True)
            for mode, kwargs in (("cpu-tuning", {"cpu_tuning": True}),
                                 ("gloo-overlap", {"overlap_grad_reduce": True}))}
    # ZeRO-1 with its parameter all-gather overlapped too: the tied embedding's bucket lives on both
    # ends of the pipeline and is used by the last stage's head, not by a module of its own there
    runs[(True, "param-gather")] = _run(pp=2, zero1=True, clip_grad=0.05, overlap_grad_reduce=True,
                                        overlap_param_gather=True)
    return runs


def test_pp2_dp2_overlap_and_zero1_equal_plain_data_parallel():
    for rank in run_distributed(_pp2_dp2, 4, timeout=600):
        base = rank[(False, "cpu-tuning")]
        assert min(base["norms"]) > 0.05  # clipping acts on every step
        for key, run in rank.items():
            assert run["losses"] == base["losses"], key
            # the CPU tuning's microbatch accumulation (cpu/accumulate.py) is installed only with it
            assert run["accumulate"] == ("accumulate_grad" if key[1] == "cpu-tuning" else "add_"), key
            # ... and its cache-sized pieces of the norm's fp64 squares (the norms below: equal to 1e-12)
            assert (run["norm_piece"] is not None) == (key[1] == "cpu-tuning"), (key, run["norm_piece"])
            # ... and its shared-memory collectives, the embedding group's sum over stages included
            assert run["communicators"] == (["dp", "dp_cp", "embedding", "mp"] if key[1] == "cpu-tuning" else []), \
                (key, run["communicators"])
            # ... and the first stage's word-embedding gradient as rows (the losses above: bitwise the dense path)
            assert run["row_grads"] == (1 if key[1] == "cpu-tuning" and run["pp_rank"] == 0 else 0), key
            torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(base["norms"]), rtol=1e-12, atol=0)
            assert len(run["one_copy"]) == STEPS and all(run["one_copy"]), key


def test_a_rank_without_gradients_sums_on_its_accelerator(monkeypatch):
    """A rank holding no gradient (its stage's parameters frozen) takes part in the norm's all-reduce with a zero:
    on the current accelerator where there is one (it was a CPU tensor, which NCCL refuses), else the CPU."""
    from lightning_megatron.optimizer.clip_grads import sum_of_squares_fp64

    assert sum_of_squares_fp64([]).device == torch.device("cpu")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("meta"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    assert sum_of_squares_fp64([]).device.type == "meta"
