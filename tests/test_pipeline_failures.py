"""A failing or missing stage ends a pipelined step within seconds instead of hanging."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
from dist_utils import DistributedTestFailure, run_distributed
from test_pipeline_schedules import B, H, S, ToyChunk, forward_step, make_microbatches

from lightning_megatron.parallel_state import initialize_model_parallel
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.pipeline import get_forward_backward_func, stage_chunks


def _pipeline(pg_timeout_s: float, vp: int | None):
    ps = initialize_model_parallel(ParallelDims(tp=1, pp=2, vp=vp), timeout=datetime.timedelta(seconds=pg_timeout_s))
    chunks = [ToyChunk(c.layers, c.pre_process) for c in stage_chunks(4, 2, ps.pp_rank, vp)]
    return ps, chunks


def _raise_mid_schedule(vp: int | None) -> None:
    ps, chunks = _pipeline(60, vp)  # a long p2p timeout: only the helper's kill can end the others

    def failing_step(microbatch, chunk):
        if ps.pp_rank == 1 and microbatch["index"] == 2:
            raise RuntimeError("stage 1 failed on microbatch 2")
        return forward_step(microbatch, chunk)

    microbatches = [dict(mb, index=i) for i, mb in enumerate(make_microbatches(4, seed=0))]
    get_forward_backward_func(2, vp)(  # interleaved: with its exchanges overlapped (posted, waited later)
        forward_step_func=failing_step, microbatches=microbatches, model=chunks, num_microbatches=4,
        parallel_state=ps, tensor_shape=(S, B, H), dtype=torch.float32, overlap_p2p_comm=vp is not None)


@pytest.mark.parametrize("vp", [None, 2], ids=["pp2", "pp2-vp2"])
def test_raising_stage_ends_the_run_quickly(vp):
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure, match=r"rank 1 of 2 failed:(.|\n)*stage 1 failed on microbatch 2"):
        run_distributed(_raise_mid_schedule, 2, vp, timeout=30)
    assert time.monotonic() - start < 20, "the healthy stage must not keep the run alive"


def _absent_stage() -> None:
    """Stage 1 never joins the step; stage 0's p2p wait must give up after the group timeout (2 s)."""
    ps, chunks = _pipeline(2, None)
    if ps.pp_rank == 1:
        time.sleep(25)  # alive but silent: no connection drop tells stage 0 anything
        return
    started = time.monotonic()
    try:
        get_forward_backward_func(2, None)(
            forward_step_func=forward_step, microbatches=make_microbatches(4, seed=0), model=chunks,
            num_microbatches=4, parallel_state=ps, tensor_shape=(S, B, H), dtype=torch.float32)
    except RuntimeError as err:
        raise RuntimeError(f"stage 0 gave up after {time.monotonic() - started:.1f}s: {err}") from err
    raise AssertionError("stage 0 finished a step without its peer")


def test_p2p_wait_is_bounded_by_group_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure, match=r"rank 0 of 2 failed:(.|\n)*stage 0 gave up after") as info:
        run_distributed(_absent_stage, 2, timeout=30)
    assert time.monotonic() - start < 20
    waited = float(str(info.value).split("gave up after ")[-1].split("s:")[0])
    assert 1.5 <= waited <= 10, f"stage 0 waited {waited}s for a 2 s group timeout"
