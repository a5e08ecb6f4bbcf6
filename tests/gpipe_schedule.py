"""A user's pipeline schedule in one file: GPipe (all forwards, then all backwards), as docs/pipeline.md
writes it. Importing this file registers it; ``MegatronStrategy(pipeline_schedule="gpipe")`` runs it."""

from __future__ import annotations

import torch

from lightning_megatron.pipeline import (
    MicrobatchRunner,
    P2PCommunicator,
    PipelineSchedule,
    device_of,
    register_schedule,
)


@register_schedule("gpipe")
class GPipe(PipelineSchedule):
    """Every microbatch forward, then every one backward: ``m`` microbatches' activations held."""

    def problem(self, pp_size, vp_size, num_microbatches=None):
        if vp_size is not None and vp_size > 1:
            return f"gpipe runs one model chunk per stage, got virtual_pipeline_model_parallel_size={vp_size}"
        return super().problem(pp_size, vp_size, num_microbatches)

    def in_flight(self, pp_size, vp_size, stage, num_microbatches):
        return num_microbatches

    def bubble(self, pp_size, vp_size, num_microbatches):
        return (pp_size - 1) / (num_microbatches + pp_size - 1)

    def run(self, *, forward_step_func, microbatches, model, num_microbatches, parallel_state, tensor_shape, dtype,
            forward_only=False, grad_scale_func=None, trace=None, overlap_p2p_comm=False, weight_grads=None):
        ps, m = parallel_state, num_microbatches
        run = MicrobatchRunner(forward_step_func=forward_step_func, microbatches=microbatches, model=model,
                               num_microbatches=m, forward_only=forward_only, grad_scale_func=grad_scale_func,
                               trace=trace, weight_grads=weight_grads)
        comm = P2PCommunicator(ps, tensor_shape, dtype, device_of(model), requires_grad=not forward_only)
        last, kept = ps.is_pipeline_last_stage(), []
        with torch.no_grad() if forward_only else torch.enable_grad():
            for i in range(m):
                input_tensor = comm.recv_forward()
                output_tensor = run.forward(i, 0, input_tensor, last_piece=last, phase="warmup")
                comm.send_forward(output_tensor)
                kept.append((input_tensor, output_tensor))
            for i in range(0 if forward_only else m):
                input_tensor, output_tensor = kept[i]
                grad = run.backward(i, 0, input_tensor, output_tensor, comm.recv_backward(), phase="cooldown")
                comm.send_backward(grad)
        return run.logged
