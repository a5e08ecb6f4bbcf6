"""The record of parallel dimensions: rank order, the ranks of every group, validation, names, records.

Pure arithmetic against hand-written tables (megatron-core's rank order tp-cp-ep-dp-pp); no process
groups. That torch.distributed takes every group a ParallelState exposes is checked on real gloo
ranks in tests/test_optimizer_clip_grads.py (one spawn shared with the clipping checks).
"""

from __future__ import annotations

import pytest

from lightning_megatron.parallel_dims import GROUP_DIMS, ParallelDims, ParallelDimsError
from lightning_megatron.parallel_state import GROUP_NAMES, ParallelState
from lightning_megatron.parallel_dims import ParallelDims


def test_rank_order_tp_fastest_then_dp_then_pp():
    d = ParallelDims(tp=2, pp=2).for_world_size(8)
    assert d.dp == 2 and d.world_size == 8
    assert d.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.group_ranks("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert d.group_ranks("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.group_ranks("dp_cp") == d.group_ranks("dp")  # no context parallelism: the same ranks
    assert d.coordinates(6) | {} == {"tp": 0, "cp": 0, "dp": 1, "pp": 1, "etp": 0, "ep": 0, "edp": 1}
    assert all(d.rank_of(**{k: v for k, v in d.coordinates(r).items() if k in ("tp", "cp", "dp", "pp")}) == r
               for r in range(8))


def test_context_parallel_sits_between_tp_and_dp():
    d = ParallelDims(tp=2, cp=2).for_world_size(8)  # tp2 cp2 dp2
    assert d.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.group_ranks("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.group_ranks("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # TP x PP: context ranks hold the same weights


def test_expert_groups_view_a_stage_as_etp_ep_edp():
    d = ParallelDims(tp=2, ep=2).for_world_size(8)  # dense tp2 dp4; experts etp2 ep2 edp2
    assert d.expert_dp == 2
    assert d.group_ranks("expert_tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.group_ranks("expert_dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    d = ParallelDims(tp=2, pp=2, ep=2, etp=1).for_world_size(8)  # a stage: 4 ranks = etp1 ep2 edp2
    assert d.group_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.group_ranks("expert_dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_every_rank_is_in_one_group_of_each_name():
    for d in (ParallelDims(tp=2, pp=2).for_world_size(8), ParallelDims(tp=2, cp=2, ep=2).for_world_size(16),
              ParallelDims(pp=4, vp=2).for_world_size(4)):
        for name in GROUP_DIMS:
            flat = sorted(r for g in d.group_ranks(name) for r in g)
            assert flat == list(range(d.world_size)), (d.name, name)
    assert set(GROUP_NAMES) == set(GROUP_DIMS) | {"embedding"}


def test_bad_sizes_list_every_problem_with_the_numbers():
    with pytest.raises(ParallelDimsError, match=r"world_size=6 is not divisible by tensor_model_parallel_size=4"):
        ParallelDims(tp=4).for_world_size(6)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 x pipeline_model_parallel_size=3 \(= 6\)"):
        ParallelDims(tp=2, pp=3).for_world_size(8)
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=2 needs pipeline"):
        ParallelDims(vp=2)
    with pytest.raises(ParallelDimsError) as e:
        ParallelDims(tp=0, pp=-1)
    assert len(e.value.problems) == 2 and "tensor_model_parallel_size=0" in e.value.problems[0]
    with pytest.raises(ValueError, match="sequence_parallel=True has no effect"):
        ParallelDims(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"dp=3 but world_size=8 / \(tp=2 x cp=1 x pp=1\) = 4"):
        ParallelDims(tp=2, dp=3).for_world_size(8)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size=2 x expert_model_parallel_size=3"):
        ParallelDims(tp=2, ep=3).for_world_size(4)
    with pytest.raises(ValueError, match="not resolved"):
        _ = ParallelDims(tp=2).world_size


def test_names_parse_back_to_the_same_record():
    for text in ("tp1", "tp2", "pp2vp2", "tp2pp2dp2", "tp2sp", "dp2zero1", "tp2cp2", "ep2", "tp2pp2-1f1b",
                 "pp2-gpipe"):
        d = ParallelDims.parse(text)
        assert d.name == text and ParallelDims.parse(d.name) == d
    d = ParallelDims.parse("tp2-pp2_dp2")
    assert (d.tp, d.pp, d.dp, d.schedule) == (2, 2, 2, "auto") and d.world_size == 8
    assert [x.name for x in ParallelDims.parse_list("tp2, pp2vp2,dp2zero1")] == ["tp2", "pp2vp2", "dp2zero1"]
    for bad, match in (("tp2x", "cannot read"), ("tp2tp2", "given twice"), ("", "empty"), ("vp2", "needs pipeline")):
        with pytest.raises(ValueError, match=match):
            ParallelDims.parse(bad)


def test_checkpoint_records_old_and_new():
    d = ParallelDims(tp=2, pp=2, vp=2, sequence_parallel=True).for_world_size(8)
    record = d.as_record()
    assert record["world_size"] == 8 and ParallelDims.from_record(record) == d
    old = {"world_size": 4, "tp": 2, "pp": 1, "vp": None, "dp": 2}  # written before the record existed
    assert ParallelDims.from_record(old) == ParallelDims(tp=2, dp=2)


def test_what_the_engine_does_not_take_yet_is_named():
    assert ParallelDims(tp=2).unsupported() == []
    assert ParallelDims(cp=2).unsupported() == []  # the module's to take (module.context_parallel_problem)
    assert ParallelDims(ep=2).unsupported() == []  # the model's to take (num_moe_experts)
    assert "other than the TP size (2) is not supported yet" in ParallelDims(tp=2, etp=1).unsupported()[0]


def test_tp_groups_stay_within_a_node_when_devices_are_a_multiple_of_tp():
    """Nodes hold ``devices`` consecutive ranks (torchrun, SLURM): TP groups, consecutive ranks too,
    stay within one when devices % tp == 0 (the strategy warns about the others at set-up)."""
    from lightning_megatron.setup_checks import tp_groups_across_nodes

    d = ParallelDims(tp=2).for_world_size(4)
    assert tp_groups_across_nodes(d, [0, 0, 1, 1]) == []  # 2 nodes x 2 processes
    assert tp_groups_across_nodes(d, [0, 1, 2, 3]) == [[0, 1], [2, 3]]  # 4 nodes x 1 process
    d = ParallelDims(tp=2).for_world_size(6)
    assert tp_groups_across_nodes(d, [0, 0, 0, 1, 1, 1]) == [[2, 3]]  # 2 nodes x 3 processes


def test_a_single_process_state_has_no_groups():
    ps = ParallelState.single_process()
    assert (ps.tp_size, ps.dp_size, ps.pp_size, ps.tp_rank, ps.pp_rank) == (1, 1, 1, 0, 0)
    assert all(ps.group(name) is None for name in GROUP_NAMES) and ps.tp_group is None and ps.mp_group is None
    assert ps.coordinates["tp"] == 0 and ps.pp_ranks == [0]
    with pytest.raises(ValueError, match="resolved dims"):
        ParallelState(dims=ParallelDims(tp=2))
