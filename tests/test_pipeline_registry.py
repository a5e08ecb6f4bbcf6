"""The named pipeline schedules (pipeline/registry.py): names, the ``auto`` rule, refusals naming the
registered names, in-flight microbatches and bubble against docs/pipeline.md's closed forms, a user's
schedule registered from a file of its own (tests/gpipe_schedule.py), the strategy's and the
configuration check's ``pipeline_schedule``, and the estimates asking the schedule. Pure arithmetic:
the runs of the schedules (traced, and against one process) are in tests/test_pipeline_schedules.py."""

from __future__ import annotations

import pytest
from gpipe_schedule import GPipe

from lightning_megatron.pipeline import (
    PipelineSchedule,
    auto_schedule_name,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_schedule,
    pipeline_schedule_problem,
    register_schedule,
    schedule_names,
)

BUILT_IN = ["no_pipelining", "1f1b", "interleaved"]


def test_names_and_the_auto_rule():
    assert schedule_names()[:3] == BUILT_IN and "gpipe" in schedule_names()
    for (pp, vp), name, run in [((1, None), "no_pipelining", forward_backward_no_pipelining),
                                ((4, None), "1f1b", forward_backward_pipelining_without_interleaving),
                                ((4, 1), "1f1b", forward_backward_pipelining_without_interleaving),
                                ((4, 2), "interleaved", forward_backward_pipelining_with_interleaving)]:
        assert auto_schedule_name(pp, vp) == name
        schedule = get_schedule("auto", pp, vp)
        assert schedule is get_schedule(name, pp, vp) and schedule.name == name
        assert schedule.run is run  # Megatron's functions, unchanged
    assert isinstance(get_schedule("gpipe", 2, None), GPipe)


def test_unknown_or_unfitting_schedules_are_refused_naming_the_registered_ones():
    problem = pipeline_schedule_problem("zero_bubble", 2, None)
    assert "pipeline_schedule='zero_bubble' is not a registered schedule" in problem
    assert all(repr(name) in problem for name in BUILT_IN + ["gpipe"]) and "'auto'" in problem
    with pytest.raises(ValueError, match="is not a registered schedule"):
        get_schedule("zero_bubble", 2, None)
    assert pipeline_schedule_problem(None, 1, None) is not None
    for name, pp, vp, says in [("1f1b", 1, None, "1f1b needs pipeline_model_parallel_size >= 2, got 1"),
                               ("1f1b", 2, 2, "1f1b runs one model chunk per stage"),
                               ("no_pipelining", 2, None, "no_pipelining runs one stage"),
                               ("interleaved", 2, None, "interleaved needs pipeline_model_parallel_size >= 2 and "
                                                        "virtual_pipeline_model_parallel_size >= 2, got 2 and None"),
                               ("gpipe", 2, 2, "gpipe runs one model chunk per stage")]:
        assert pipeline_schedule_problem(name, pp, vp).startswith(f"pipeline_schedule={name!r}: {says}"), name
    # The microbatch rules (Megatron's): at least one; the interleaved schedule m % p == 0.
    assert pipeline_schedule_problem("auto", 4, None, 3) is None  # 1F1B takes any m >= 1
    assert pipeline_schedule_problem("auto", 4, 2, 8) is None
    with pytest.raises(ValueError, match=r"num_microbatches=6 is not divisible by pipeline_model_parallel_size=4.*"
                                         r"virtual_pipeline_model_parallel_size=2"):
        get_schedule("auto", 4, 2).validate(4, 2, 6)
    for name, pp in (("1f1b", 2), ("gpipe", 2), ("no_pipelining", 1)):
        with pytest.raises(ValueError, match="num_microbatches=0 must be a positive integer"):
            get_schedule(name, pp, None).validate(pp, None, 0)


def test_registering_a_schedule():
    with pytest.raises(ValueError, match=r"'gpipe' is already gpipe_schedule.GPipe; choose another name"):
        @register_schedule("gpipe")
        class Other(GPipe):
            pass
    with pytest.raises(ValueError, match="other than 'auto'"):
        register_schedule("auto")
    with pytest.raises(TypeError, match="decorates a PipelineSchedule subclass"):
        register_schedule("plain")(object)
    assert "plain" not in schedule_names() and isinstance(get_schedule("gpipe", 2, None), GPipe)
    with pytest.raises(TypeError, match="abstract"):  # run, in_flight and bubble are the contract
        PipelineSchedule()


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 12])
def test_in_flight_and_bubble_are_the_closed_forms(p, m):
    """docs/pipeline.md: 1F1B holds at most ``p - r`` microbatches on stage r and idles
    ``(p - 1)/(m + p - 1)``; interleaved ``min(m v, 2 (p - r - 1) + (v - 1) p + 1)`` chunk forwards and
    ``(p - 1)/(v m + p - 1)``; GPipe ``m`` and 1F1B's bubble; no pipelining one, and no bubble."""
    one, fb = get_schedule("no_pipelining", 1, None), get_schedule("1f1b", p, None)
    gpipe = get_schedule("gpipe", p, None)
    assert one.in_flight(1, None, 0, m) == 1 and one.bubble(1, None, m) == 0
    for r in range(p):
        assert fb.in_flight(p, None, r, m) == min(m, p - r)
        assert gpipe.in_flight(p, None, r, m) == m >= fb.in_flight(p, None, r, m)
    assert fb.bubble(p, None, m) == gpipe.bubble(p, None, m) == (p - 1) / (m + p - 1)
    assert fb.in_flight(p, None, 0, m) == min(m, p)  # the peak is stage 0's
    for v in (2, 3):
        inter = get_schedule("interleaved", p, v)
        for r in range(p):
            assert inter.in_flight(p, v, r, m) == min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)
        assert inter.bubble(p, v, m) == (p - 1) / (v * m + p - 1) < fb.bubble(p, None, m)


def test_strategy_takes_a_registered_name_or_auto():
    from lightning_megatron.strategy import MegatronStrategy

    assert MegatronStrategy().parallel_dims.schedule == "auto"
    assert MegatronStrategy(pipeline_model_parallel_size=2, pipeline_schedule="gpipe").parallel_dims.schedule == "gpipe"
    with pytest.raises(ValueError, match=r"MegatronStrategy: pipeline_schedule='zb' is not a registered schedule; "
                                         r"use 'auto' or one of \['no_pipelining', '1f1b', 'interleaved'"):
        MegatronStrategy(pipeline_model_parallel_size=2, pipeline_schedule="zb")
    with pytest.raises(ValueError, match="pipeline_schedule='interleaved': interleaved needs"):
        MegatronStrategy(pipeline_model_parallel_size=2, pipeline_schedule="interleaved")


def test_config_check_refuses_a_schedule_before_launch():
    from lightning_megatron.config_checks import check_config

    def problems(schedule: str, vp: int | None = None, global_batch: int = 6) -> list[str]:
        return check_config(strategy_args={"pipeline_model_parallel_size": 2, "pipeline_schedule": schedule,
                                           "virtual_pipeline_model_parallel_size": vp},
                            data_hparams={"global_batch_size": global_batch, "micro_batch_size": 1},
                            trainer_args={"devices": 2})

    assert problems("gpipe") == [] and problems("auto") == [] and problems("1f1b", global_batch=3) == []
    [unknown] = problems("zb")
    assert "pipeline_schedule='zb' is not a registered schedule" in unknown and "'gpipe'" in unknown
    assert problems("no_pipelining") == ["pipeline_schedule='no_pipelining': no_pipelining runs one stage, got "
                                         "pipeline_model_parallel_size=2; use '1f1b' (or 'auto')"]
    [odd] = problems("auto", vp=2, global_batch=3)  # 3 microbatches: the interleaved schedule's rule
    assert odd.startswith("pipeline_schedule='interleaved': num_microbatches=3 is not divisible by "
                          "pipeline_model_parallel_size=2")


class _Cost:
    """A cost model of 4 layers: 1000 activation bytes per layer and microbatch, 50 more on the last stage."""

    num_layers, micro_batch_size, global_batch_size, param_bytes, optimizer, recompute = 4, 1, 8, 4, "sgd", False

    def stage_parameters(self, tp: int, pp: int, stage: int) -> int:
        return self.num_layers // pp * 100 // tp

    def layer_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return 1000.0

    def layer_input_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return 10.0

    def first_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return 0.0

    def last_stage_activation_bytes(self, tp: int, sequence_parallel: bool) -> float:
        return 50.0


def test_estimates_ask_the_schedule():
    """--estimate-memory holds the schedule's in-flight forwards, --estimate-time idles its bubble."""
    from lightning_megatron.parallel_dims import ParallelDims
    from lightning_megatron.cost import TransformerCost, estimate_stage
    from lightning_megatron.check.timing import Device, Efficiency, estimate_time

    cost, layout = _Cost(), ParallelDims(pp=2, dp=1)  # 8 microbatches of 2 layers per stage
    for stage, (one_f_one_b, all_forwards) in enumerate([(2, 8), (1, 8)]):
        head = 50 if stage == 1 else 0
        assert estimate_stage(cost, layout, stage).activation_bytes == one_f_one_b * 2 * 1000 + head
        assert estimate_stage(cost, layout, stage, schedule="gpipe").activation_bytes == all_forwards * 2 * 1000 + head
    shape = TransformerCost(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=32,
                            micro_batch_size=2, global_batch_size=8)  # 4 microbatches
    dev = Device(name="toy", flops_16=1e12, flops_32=1e12, hbm=1e11, link_intra=1e10, link_inter=1e10,
                 devices_per_node=8, latency_intra=0.0, latency_inter=0.0)
    auto = estimate_time(shape, layout, dev, Efficiency())  # 1F1B at p=2: idle (p - 1) = one microbatch's time
    assert estimate_time(shape, layout, dev, Efficiency(), schedule="gpipe").bubble == pytest.approx(auto.bubble)
    assert estimate_time(shape, ParallelDims(dp=1), dev, Efficiency()).bubble == 0.0  # no_pipelining
    # A schedule idling half the step idles as long as it works: m = 4 microbatches' time.
    half = estimate_time(shape, layout, dev, Efficiency(), schedule=_Fixed())
    assert half.bubble == pytest.approx(4 * auto.bubble, rel=1e-12) and half.compute == auto.compute
    assert estimate_stage(cost, layout, 0, schedule=_Fixed()).activation_bytes == 3 * 2 * 1000


class _Fixed(PipelineSchedule):
    """Not registered: estimates take a schedule object too."""

    def run(self, **kwargs):
        raise NotImplementedError

    def in_flight(self, pp_size, vp_size, stage, num_microbatches):
        return 3

    def bubble(self, pp_size, vp_size, num_microbatches):
        return 0.5


def test_a_schedule_chooses_the_weight_grads_it_runs_apart():
    """StepRunner hands the schedule its weight-gradient policy once (``configure_weight_grads``): what
    a zero-bubble schedule uses to defer every linear layer; the built-in schedules defer none."""
    from types import SimpleNamespace

    import torch

    from lightning_megatron.parallel_state import ParallelState
    from lightning_megatron.step import StepRunner
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class SplitGPipe(GPipe):  # not registered: StepRunner takes the object
        def configure_weight_grads(self, weight_grads, chunks):
            weight_grads.defer([m for c in chunks for m in c.modules() if isinstance(m, (ColumnParallelLinear,
                                                                                          RowParallelLinear))])

    chunk = torch.nn.Sequential(ColumnParallelLinear(4, 8), RowParallelLinear(8, 4), torch.nn.Linear(4, 4))
    module = SimpleNamespace(model_chunks=[chunk])
    common = dict(micro_batch_size=None, device=torch.device("cpu"))
    split = StepRunner(ParallelState.single_process(), module, schedule=SplitGPipe(), **common).weight_grads
    assert split.deferral(chunk[0]) is split.deferral(chunk[1]) is not None and split.deferral(chunk[2]) is None
    plain = StepRunner(ParallelState.single_process(), module, schedule=get_schedule("auto", 1, None), **common)
    assert plain.weight_grads.deferrals == [] and plain.schedule.name == "no_pipelining"
