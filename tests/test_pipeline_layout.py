"""Pure-arithmetic parts of the pipeline: layer layout, schedule choice, microbatch validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.pipeline import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    get_layer_range,
    get_schedule,
    is_first_chunk_stage,
    is_last_chunk_stage,
    stage_chunks,
)


@pytest.mark.parametrize(
    ("num_layers", "pp", "vp", "expected"),
    [
        # expected[pp_rank][vp_rank] = (start, stop)
        (8, 2, None, [[(0, 4)], [(4, 8)]]),
        (8, 4, None, [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]),
        # interleaved: piece vp * pp + pp_rank; stage 0 holds pieces 0 and 2
        (8, 2, 2, [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]),
        (8, 4, 2, [[(0, 1), (4, 5)], [(1, 2), (5, 6)], [(2, 3), (6, 7)], [(3, 4), (7, 8)]]),
        # uneven: the first L % pieces pieces get one extra layer
        (10, 4, None, [[(0, 3)], [(3, 6)], [(6, 8)], [(8, 10)]]),
        (6, 2, 2, [[(0, 2), (4, 5)], [(2, 4), (5, 6)]]),
        (5, 1, None, [[(0, 5)]]),
    ],
    ids=lambda x: str(x),
)
def test_layer_range_table(num_layers, pp, vp, expected):
    v = 1 if vp is None else vp
    got = [[(r.start, r.stop) for r in (get_layer_range(num_layers, pp, s, vp, c) for c in range(v))]
           for s in range(pp)]
    assert got == expected
    # The pieces tile [0, L) exactly once.
    covered = sorted(i for s in range(pp) for c in range(v) for i in get_layer_range(num_layers, pp, s, vp, c))
    assert covered == list(range(num_layers))


@pytest.mark.parametrize(
    ("num_layers", "pp", "vp", "first", "last", "expected"),
    [
        # megatron-core's num_layers_in_first/last_pipeline_stage; expected[pp_rank][vp_rank] = (start, stop)
        (12, 2, None, None, 4, [[(0, 8)], [(8, 12)]]),
        (12, 2, None, 7, None, [[(0, 7)], [(7, 12)]]),
        (10, 4, None, 1, 1, [[(0, 1)], [(1, 5)], [(5, 9)], [(9, 10)]]),
        (11, 4, None, None, 2, [[(0, 3)], [(3, 6)], [(6, 9)], [(9, 11)]]),
        # interleaved: each stage splits its layers over its chunks; pieces stay in piece order
        (12, 2, 2, None, 4, [[(0, 4), (6, 10)], [(4, 6), (10, 12)]]),
        (9, 2, 2, 5, 4, [[(0, 3), (5, 7)], [(3, 5), (7, 9)]]),
    ],
    ids=lambda x: str(x),
)
def test_layer_range_uneven_stages(num_layers, pp, vp, first, last, expected):
    v = 1 if vp is None else vp
    kw = dict(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    got = [[(r.start, r.stop) for r in (get_layer_range(num_layers, pp, s, vp, c, **kw) for c in range(v))]
           for s in range(pp)]
    assert got == expected
    pieces = sorted((c * pp + s, get_layer_range(num_layers, pp, s, vp, c, **kw)) for s in range(pp) for c in range(v))
    assert [i for _, r in pieces for i in r] == list(range(num_layers))  # piece order tiles [0, L)
    for stage, n in ((0, first), (pp - 1, last)):
        if n is not None:
            assert sum(b - a for a, b in got[stage]) == n


def test_layer_range_uneven_stages_refused():
    with pytest.raises(ValueError, match=r"num_layers=8 does not fit .*first_pipeline_stage=5.*last_pipeline_stage=4"):
        get_layer_range(8, 2, 0, num_layers_in_first_pipeline_stage=5, num_layers_in_last_pipeline_stage=4)
    with pytest.raises(ValueError, match=r"2 layers are left for 2 other stage\(s\) of 2 chunk"):
        get_layer_range(8, 4, 0, 2, 0, num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=3)
    with pytest.raises(ValueError, match=r"num_layers_in_last_pipeline_stage=4 needs pipeline_model_parallel_size >= 2"):
        get_layer_range(8, 1, 0, num_layers_in_last_pipeline_stage=4)
    # fewer layers than the stage's model chunks: said as that rule alone, with the fix (it said "needs
    # pipeline_model_parallel_size >= 2 (got 2) and at least one layer per model chunk", as if the first rule failed)
    with pytest.raises(ValueError) as refused:
        get_layer_range(5, 2, 0, 2, 0, num_layers_in_first_pipeline_stage=1)
    assert str(refused.value) == (
        "num_layers_in_first_pipeline_stage=1 is fewer layers than the stage's 2 model chunks "
        "(virtual_pipeline_model_parallel_size=2; every chunk needs at least one layer): give it at least 2 layers, "
        "or fewer chunks"), refused.value


def test_layer_range_rejects_more_pieces_than_layers():
    with pytest.raises(ValueError, match=r"num_layers=6 .*pp_size=4 \* vp_size=2 = 8"):
        get_layer_range(6, 4, 0, 2, 0)
    with pytest.raises(ValueError, match=r"pp_rank=2 is outside \[0, pp_size=2\)"):
        get_layer_range(8, 2, 2)
    with pytest.raises(ValueError, match=r"vp_rank=2 is outside \[0, vp_size=2\)"):
        get_layer_range(8, 2, 0, 2, 2)


def test_embedding_and_loss_chunks():
    chunks = {s: stage_chunks(8, 4, s, 2) for s in range(4)}
    pre = [(s, c.vp_rank) for s, cs in chunks.items() for c in cs if c.pre_process]
    post = [(s, c.vp_rank) for s, cs in chunks.items() for c in cs if c.post_process]
    assert pre == [(0, 0)] and post == [(3, 1)]
    assert is_first_chunk_stage(0, 0) and not is_first_chunk_stage(0, 1) and not is_first_chunk_stage(1, 0)
    assert is_last_chunk_stage(3, 4, 1, 2) and not is_last_chunk_stage(3, 4, 0, 2) and is_last_chunk_stage(1, 2)
    assert [c.layers for c in chunks[2]] == [range(2, 3), range(6, 7)]


def test_schedule_choice():
    assert get_forward_backward_func(1, None) is forward_backward_no_pipelining
    assert get_forward_backward_func(4, None) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, 1) is forward_backward_pipelining_without_interleaving
    assert get_forward_backward_func(4, 2) is forward_backward_pipelining_with_interleaving


def test_validate_num_microbatches():
    get_schedule("auto", 4, None).validate(4, None, 3)  # 1F1B takes any m >= 1 (warm-up is capped at m)
    get_schedule("auto", 4, 2).validate(4, 2, 8)
    with pytest.raises(ValueError, match=r"num_microbatches=6 is not divisible by pipeline_model_parallel_size=4.*"
                                         r"virtual_pipeline_model_parallel_size=2"):
        get_schedule("auto", 4, 2).validate(4, 2, 6)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        get_schedule("auto", 2, None).validate(2, None, 0)


class _Chunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def set_input_tensor(self, tensor):  # pragma: no cover - never reached
        raise AssertionError("the schedule ran a forward pass before validating")


def test_invalid_microbatches_raise_before_any_communication():
    """No process group exists here: any p2p call would fail with a different error than ValueError."""
    ps = ParallelState(dims=ParallelDims(pp=4, vp=2, dp=1), rank=1, members={"pp": [0, 1, 2, 3]})
    common = dict(forward_step_func=None, parallel_state=ps, tensor_shape=(2, 1, 2), dtype=torch.float32)
    with pytest.raises(ValueError, match="num_microbatches=6 is not divisible by pipeline_model_parallel_size=4"):
        forward_backward_pipelining_with_interleaving(microbatches=[{}] * 6, model=[_Chunk(), _Chunk()],
                                                      num_microbatches=6, **common)
    with pytest.raises(ValueError, match="got 3 microbatches but num_microbatches=4"):
        forward_backward_pipelining_with_interleaving(microbatches=[{}] * 3, model=[_Chunk(), _Chunk()],
                                                      num_microbatches=4, **common)
    with pytest.raises(ValueError, match="num_microbatches=0"):
        forward_backward_pipelining_without_interleaving(microbatches=[], model=[_Chunk()], num_microbatches=0,
                                                         **common)
    with pytest.raises(ValueError, match="expects 1 model chunk"):
        forward_backward_pipelining_without_interleaving(microbatches=[{}] * 2, model=[_Chunk(), _Chunk()],
                                                         num_microbatches=2, **common)


def test_a_loss_func_breaking_the_contract_is_named():
    """forward_step returns ``(output, loss_func)`` and ``loss_func(output)`` returns ``(loss, dict to log)``: a
    bare tensor raised "iteration over a 0-d tensor" inside the schedule, a missing loss_func "'NoneType' object is
    not callable"; each says the contract now."""
    ps = ParallelState(dims=ParallelDims(dp=1), rank=0, members={})
    chunk = nn.Linear(2, 2)
    common = dict(microbatches=[torch.ones(1, 2)], model=[chunk], num_microbatches=1, parallel_state=ps,
                  tensor_shape=(1, 1, 2), dtype=torch.float32)

    def returns(loss_func):
        return lambda microbatch, module: (module(microbatch), loss_func)

    with pytest.raises(TypeError, match=r"loss_func must return \(loss, dict of values to log\).*got a Tensor"):
        forward_backward_no_pipelining(forward_step_func=returns(lambda out: out.sum()), **common)
    with pytest.raises(TypeError, match="forward_step returned no loss_func on the last pipeline piece"):
        forward_backward_no_pipelining(forward_step_func=returns(None), **common)
    logged = forward_backward_no_pipelining(
        forward_step_func=returns(lambda out: (out.sum(), {"loss": out.sum().detach()})), **common)
    assert len(logged) == 1 and set(logged[0]) == {"loss"}


def test_a_rank_batch_the_micro_batch_does_not_divide_names_both_batch_knobs():
    """With a plain DataLoader (no global_batch_size anywhere) the message named only the datamodule's knob: it
    names the DataLoader's batch_size, which is each rank's, too."""
    from lightning_megatron.pipeline.microbatches import split_microbatches

    assert [len(m) for m in split_microbatches(torch.zeros(6, 2), 3)] == [3, 3]
    with pytest.raises(ValueError, match=r"a plain DataLoader's batch_size, which is each rank's, a multiple of "
                                         r"micro_batch_size"):
        split_microbatches({"x": torch.zeros(8, 2)}, 3)


def test_tensor_parallel_that_splits_nothing_is_said():
    """Parallel layers built without the strategy's tp_group (in ``__init__``) at TP=2: nothing is split and each
    rank runs the whole model, which trained without a word; set-up warns. A layer built with a TP group of 2
    (faked here: the facts a split layer records) is split: nothing said."""
    from lightning_megatron.setup_checks import unsplit_model_warning
    from lightning_megatron.tensor_parallel import ColumnParallelLinear
    from lightning_megatron.tensor_parallel.param_facts import set_param_facts

    tp2 = ParallelState(dims=ParallelDims(tp=2, dp=1), rank=0, members={})
    from lightning_megatron.tensor_parallel import mark_replicated

    unsplit = nn.Sequential(ColumnParallelLinear(4, 8, tp_group=None), nn.LayerNorm(8))
    mark_replicated(unsplit.parameters())  # as the strategy's set-up does first
    message = unsplit_model_warning([unsplit], tp2)
    assert message.startswith("tensor_model_parallel_size=2 but no parameter of the model is split"), message
    assert unsplit_model_warning([unsplit], ParallelState(dims=ParallelDims(dp=1), rank=0, members={})) is None
    set_param_facts(unsplit[0].weight, sharded_over=("tp",), replicated_over=(), partition_dim=0)
    assert unsplit_model_warning([unsplit], tp2) is None
