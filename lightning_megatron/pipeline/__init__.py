"""Pipeline parallelism without Lightning: layer layout, point-to-point transfers, microbatch schedules.

- :mod:`.layout`: which global layers each stage and virtual model chunk owns.
- :mod:`.p2p`: batched isend/irecv of ``[s, b, h]`` activations and their gradients.
- :mod:`.schedules`: no pipelining, 1F1B and interleaved 1F1B (Megatron's schedules).
- :mod:`.registry`: the named schedules (``no_pipelining``, ``1f1b``, ``interleaved``, yours):
  run, fit to a layout, activations in flight and bubble.
"""

from __future__ import annotations

from lightning_megatron.pipeline.layout import (
    ChunkLayout,
    get_layer_range,
    get_num_layers_to_build,
    is_first_chunk_stage,
    is_last_chunk_stage,
    stage_chunks,
)
from lightning_megatron.pipeline.p2p import P2PCommunicator
from lightning_megatron.pipeline.registry import (
    AUTO,
    PipelineSchedule,
    auto_schedule_name,
    get_forward_backward_func,
    get_schedule,
    pipeline_schedule_problem,
    register_schedule,
    schedule_names,
)
from lightning_megatron.pipeline.schedules import (
    MicrobatchRunner,
    ScheduleEvent,
    deallocate_output_tensor,
    device_of,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
)

__all__ = [
    "AUTO",
    "ChunkLayout",
    "MicrobatchRunner",
    "P2PCommunicator",
    "PipelineSchedule",
    "ScheduleEvent",
    "auto_schedule_name",
    "deallocate_output_tensor",
    "device_of",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
    "get_layer_range",
    "get_num_layers_to_build",
    "get_schedule",
    "is_first_chunk_stage",
    "is_last_chunk_stage",
    "pipeline_schedule_problem",
    "register_schedule",
    "schedule_names",
    "stage_chunks",
]
