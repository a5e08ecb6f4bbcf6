"""Consumed-samples batch samplers: DP slices cover each global batch once; a resume continues exactly."""

from __future__ import annotations

import itertools

import pytest

from lightning_megatron.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler

LAYOUTS = [(2, 1, 1), (2, 2, 2), (1, 4, 2), (3, 2, 4)]  # (micro_batch_size, num_microbatches, dp_size)
IDS = [f"mbs{m}-nmb{n}-dp{d}" for m, n, d in LAYOUTS]


def _samplers(cls, total, consumed, mbs, nmb, dp, **kwargs):
    return [cls(total_samples=total, consumed_samples=consumed, micro_batch_size=mbs, data_parallel_rank=r,
                data_parallel_size=dp, num_microbatches=nmb, **kwargs) for r in range(dp)]


@pytest.mark.parametrize(("mbs", "nmb", "dp"), LAYOUTS, ids=IDS)
def test_dp_ranks_take_disjoint_contiguous_slices_covering_each_global_batch(mbs, nmb, dp):
    gbs = mbs * nmb * dp
    total = 5 * gbs + gbs // 2  # a ragged tail, dropped
    samplers = _samplers(MegatronPretrainingSampler, total, 0, mbs, nmb, dp)
    per_rank = [list(s) for s in samplers]
    assert all(len(batches) == len(s) == 5 for batches, s in zip(per_rank, samplers))
    for step in range(5):
        slices = [per_rank[r][step] for r in range(dp)]
        assert all(sl == list(range(sl[0], sl[0] + mbs * nmb)) for sl in slices)  # contiguous per rank
        assert sorted(itertools.chain(*slices)) == list(range(step * gbs, (step + 1) * gbs))


@pytest.mark.parametrize(("mbs", "nmb", "dp"), LAYOUTS, ids=IDS)
def test_resume_at_consumed_samples_continues_the_stream(mbs, nmb, dp):
    gbs = mbs * nmb * dp
    total = 7 * gbs
    full = [list(s) for s in _samplers(MegatronPretrainingSampler, total, 0, mbs, nmb, dp)]
    for k in (1, 4):
        samplers = _samplers(MegatronPretrainingSampler, total, k * gbs, mbs, nmb, dp)
        assert [list(s) for s in samplers] == [batches[k:] for batches in full]
        assert [list(s) for s in samplers] == full  # the next epoch is a whole pass
        assert all(len(s) == 7 for s in samplers)  # a whole epoch, as Lightning counts it


def test_eval_tail_is_split_when_not_dropped():
    samplers = _samplers(MegatronPretrainingSampler, 10, 0, 2, 1, 2, drop_last=False)
    batches = [list(s) for s in samplers]
    assert batches == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]] and len(samplers[0]) == 3
    assert [list(s) for s in samplers] == batches  # every evaluation sees the same batches


@pytest.mark.parametrize(("mbs", "nmb", "dp"), LAYOUTS, ids=IDS)
def test_random_sampler_epochs_cover_everything_and_resume_exactly(mbs, nmb, dp):
    gbs = mbs * nmb * dp
    total = 6 * gbs + 1
    epoch_samples = 6 * gbs

    def stream(consumed, steps):
        samplers = _samplers(MegatronPretrainingRandomSampler, total, consumed, mbs, nmb, dp, seed=5)
        out = []
        while len(out) < steps:  # each iter() is one (rest of an) epoch, like Lightning's epochs
            out.extend(zip(*(iter(s) for s in samplers)))
        return out[:steps]

    full = stream(0, 15)  # two and a half epochs
    for epoch in range(2):
        seen = [i for step in full[epoch * 6:(epoch + 1) * 6] for sl in step for i in sl]
        assert sorted(seen) == list(range(epoch_samples))  # each epoch: every sample once
        for step in full[epoch * 6:(epoch + 1) * 6]:
            for rank, sl in enumerate(step):  # rank r stays in its bucket
                assert all(rank * epoch_samples // dp <= i < (rank + 1) * epoch_samples // dp for i in sl)
    assert full[:6] != full[6:12]  # reshuffled per epoch
    for k in (1, 6, 8):
        assert stream(k * gbs, 15 - k) == full[k:]


def test_random_sampler_resumed_at_another_dp_size_reads_the_run_s_global_batches():
    """A shuffled run started at DP=2 (micro-batch 2, 2 microbatches: global batch 8) and resumed after 3 steps at
    DP=1 and DP=4 with the same global batch reads, step by step, the samples the DP=2 run goes on to read (in the
    same order across the ranks), through the next epochs too: the run's order is its first DP size's buckets
    (``buckets``), whatever ranks read it. Left to the new DP size's buckets (Megatron's sampler) the order changes:
    samples of the epoch read again, others not at all."""
    total, gbs = 8 * 6 + 3, 8

    def stream(consumed, steps, mbs, nmb, dp, **kwargs):
        samplers = _samplers(MegatronPretrainingRandomSampler, total, consumed, mbs, nmb, dp, seed=7, **kwargs)
        out = []
        while len(out) < steps:
            out.extend([i for sl in step for i in sl] for step in zip(*(iter(s) for s in samplers)))
        return out[:steps]

    full = stream(0, 15, 2, 2, 2)
    assert _samplers(MegatronPretrainingRandomSampler, total, 0, 2, 2, 2, seed=7)[0].order_key == (7, 48, 2)
    for mbs, nmb, dp in ((2, 4, 1), (1, 2, 4), (2, 1, 4)):
        assert stream(3 * gbs, 12, mbs, nmb, dp, buckets=2) == full[3:], (mbs, nmb, dp)
    regrouped = stream(3 * gbs, 3, 2, 1, 4)  # the rest of the epoch in DP=4's own buckets
    read = [i for step in full[:3] + regrouped for i in step]
    assert len(set(read)) < len(read) == 48  # some samples twice in one epoch
    with pytest.raises(ValueError, match=r"buckets=3 must divide the global batch size 8"):
        _samplers(MegatronPretrainingRandomSampler, total, 0, 2, 2, 2, buckets=3)


def test_random_sampler_seed_matters():
    a = list(_samplers(MegatronPretrainingRandomSampler, 64, 0, 4, 2, 1, seed=1)[0])
    b = list(_samplers(MegatronPretrainingRandomSampler, 64, 0, 4, 2, 1, seed=2)[0])
    assert a != b and sorted(sum(a, [])) == sorted(sum(b, []))


def test_invalid_arguments_name_the_numbers():
    with pytest.raises(ValueError, match=r"consumed_samples=5 .* global batch size 8 = micro_batch_size 2 \* "
                                         r"num_microbatches 2 \* data_parallel_size 2"):
        MegatronPretrainingRandomSampler(total_samples=64, consumed_samples=5, micro_batch_size=2,
                                         data_parallel_rank=0, data_parallel_size=2, num_microbatches=2)
    with pytest.raises(ValueError, match="consumed_samples=-8"):
        MegatronPretrainingSampler(total_samples=64, consumed_samples=-8, micro_batch_size=2,
                                   data_parallel_rank=0, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_rank=2"):
        MegatronPretrainingSampler(total_samples=64, consumed_samples=0, micro_batch_size=2,
                                   data_parallel_rank=2, data_parallel_size=2)
