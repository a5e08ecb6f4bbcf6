"""The 16-bit wrapper: bf16/fp16 model params with fp32 main params inside the optimizer (Megatron's
``Float16OptimizerWithFloat16Params``), over a tensor per parameter or, under the strategy's grad buffer, flat runs
of several (see the class). Its step is :class:`~lightning_megatron.optimizer.mixed_precision.MegatronOptimizer`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_megatron.optimizer.mixed_precision import ELEMENTWISE_OPTIMIZERS, MegatronOptimizer, zero_grads
from lightning_megatron.tensor_parallel.param_facts import copy_param_facts

__all__ = ["Float16OptimizerWithFloat16Params"]


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """bf16/fp16 model params with fp32 main params inside the optimizer.

    At construction every bf16/fp16 parameter ``p`` in the inner optimizer's groups gets an fp32 main param
    ``main_param(p)``, a copy of ``p`` (its optimizer state, if any, moves with it and its TP attributes are
    copied); fp32 parameters are their own main params. Works with or without loss scaling: bf16 usually runs
    with no scaler or ``ConstantGradScaler(1.0)``.

    **Over the strategy's grad buffer the step is flat** (issue 39's "a fused optimizer step over the flat fp32
    buffer"): when ``grad_buffer`` holds exactly the optimizer's trainable parameters, the inner optimizer is one
    of :data:`ELEMENTWISE_OPTIMIZERS` and has no state yet, the buffer is laid out by group within each bucket
    (:meth:`~lightning_megatron.grads.GradBuffer.order_within_buckets`, as ZeRO-1 lays it out), the main params
    are views of one fp32 tensor with the buffer's layout, and the inner optimizer's groups hold one flat run per
    group and bucket (the 16-bit parameters' main params, adjacent) instead of a tensor per parameter; an fp32 or
    0-dim parameter stays a tensor of its own. Its state is then the runs' (:meth:`param_state` reads a
    parameter's piece of it, as checkpoints do); ``state_dict()`` keeps the per-parameter format, so a wrapper
    stepping a tensor per parameter loads it and the other way round. Otherwise it steps a tensor per parameter.

    ``state_dict() = {"optimizer", "grad_scaler", "fp32_from_fp16_params"}`` (Megatron's keys).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self.float16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_float16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        self._main_by_param: dict[int, torch.Tensor] = {}  # id(16-bit model param) -> its fp32 main param
        flat = self._flat_layout()  # the buffer's layout of fp32 main params, or None: a tensor per parameter
        for group in self.optimizer.param_groups:
            float16_params, fp32_from_float16_params, fp32_params = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in (torch.float16, torch.bfloat16):
                    if flat is None:
                        main_param = param.detach().clone().float()
                    else:
                        offset = self._grad_buffer.offsets[id(param)]
                        main_param = flat[offset: offset + param.numel()].view_as(param)
                        main_param.copy_(param.detach())
                    copy_param_facts(param, main_param)  # the norm counts it as its model param
                    group["params"][i] = main_param
                    self._main_by_param[id(param)] = main_param
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                    float16_params.append(param)
                    fp32_from_float16_params.append(main_param)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                else:
                    raise TypeError(
                        f"parameter of dtype {param.dtype} is not supported; use float32, float16 or bfloat16"
                    )
            self.float16_groups.append(float16_params)
            self.fp32_from_float16_groups.append(fp32_from_float16_params)
            self.fp32_from_fp32_groups.append(fp32_params)
        # The flat step's records (empty when it steps a tensor per parameter): each group's parameters as the
        # inner optimizer held them (main params and fp32 parameters: the norm's and state_dict's), where each
        # main param lies in a run, and each run with its gradient (a view of the buffer over the same elements).
        self._per_param_groups: list[list[torch.Tensor]] = []
        self._run_of: dict[int, tuple[torch.Tensor, int]] = {}
        self._run_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        if flat is not None:
            self._step_runs(flat)

    def _flat_layout(self) -> torch.Tensor | None:
        """The fp32 tensor the main params are views of, laid out as the grad buffer (ordered here by group
        within each bucket), when the step can be flat (see the class doc); None otherwise."""
        buffer = self._grad_buffer
        trainable = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        if (buffer is None or self.optimizer.state or type(self.optimizer) not in ELEMENTWISE_OPTIMIZERS
                or len(trainable) != len(buffer.params) or {id(p) for p in trainable} != {id(p) for p in buffer.params}
                or not any(p.dtype in (torch.float16, torch.bfloat16) for p in trainable)):
            return None
        group_of = {id(p): k for k, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        try:  # within a group the 16-bit parameters first: their main params adjacent, one run
            buffer.order_within_buckets(lambda p: 2 * group_of[id(p)] + (p.dtype == torch.float32 or p.dim() == 0))
        except RuntimeError:  # the buffer already holds a step's values (a wrapper built mid-run): per parameter
            return None
        return torch.zeros_like(buffer.data)

    def _step_runs(self, flat: torch.Tensor) -> None:
        """Hand the inner optimizer one run of adjacent main params per group and bucket (the buffer's runs of
        their gradients, :meth:`~lightning_megatron.grads.GradBuffer.runs_of`, over the same elements of
        ``flat``). A 16-bit parameter's main param with its shape stays the checkpoints' and the norm's, its
        gradient set once: the buffer's view of its elements, read anew each step."""
        buffer = self._grad_buffer
        assert buffer is not None
        base = buffer.data.storage_offset()  # flat has the buffer's layout: the same offsets
        for group, model_params in zip(self.optimizer.param_groups, self.float16_groups):
            self._per_param_groups.append(list(group["params"]))
            for p in model_params:
                self._main_by_param[id(p)].grad = buffer.main_grad_of(p)
            # a 0-dim parameter is stepped as itself: a run's per-element state would have another shape
            stepped = [p for p in model_params if p.dim() > 0]
            runs = []
            for grad in buffer.runs_of([buffer.main_grad_of(p) for p in stepped]):
                start = grad.storage_offset() - base
                runs.append((start, flat[start: start + grad.numel()]))
                self._run_grads.append((runs[-1][1], grad))
            for p in stepped:
                offset = buffer.offsets[id(p)]
                start, run = next((s, r) for s, r in runs if s <= offset < s + r.numel())
                self._run_of[id(self._main_by_param[id(p)])] = (run, offset - start)
            in_runs = {id(self._main_by_param[id(p)]) for p in stepped}
            group["params"] = [run for _, run in runs] + [p for p in group["params"] if id(p) not in in_runs]

    def main_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 main copy of a 16-bit ``param``; an fp32 ``param`` itself."""
        return self._main_by_param.get(id(param), param)

    def model_parameters(self) -> list[torch.Tensor]:
        return [p for groups in (self.float16_groups, self.fp32_from_fp32_groups) for group in groups for p in group]

    def param_state(self, main: torch.Tensor) -> dict[str, Any]:
        entry = self._run_of.get(id(main))
        if entry is None:
            return super().param_state(main)
        run, start = entry
        return {k: v[start: start + main.numel()].view_as(main) if torch.is_tensor(v) and v.dim() > 0 else v
                for k, v in self.optimizer.state.get(run, {}).items()}

    def load_param_state(self, main: torch.Tensor, state: dict[str, Any]) -> None:
        entry = self._run_of.get(id(main))
        if entry is None:
            super().load_param_state(main, state)
            return
        run, start = entry
        held = self.optimizer.state[run]
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:  # per element: into the main param's piece of the run's
                if k not in held:
                    held[k] = torch.zeros_like(run)
                held[k][start: start + main.numel()].view_as(main).copy_(v)
            else:  # a scalar the run's parameters share (they step together: one value), the run's own tensor
                held[k] = v.clone() if torch.is_tensor(v) else v  # (optimizers increment a step in place)

    def _norm_parameters(self) -> list[torch.Tensor]:
        if not self._per_param_groups:
            return self.get_parameters()
        return [p for group in self._per_param_groups for p in group]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._per_param_groups:  # the model params and the runs (the main params' gradients are the buffer's)
            zero_grads([p for groups in (self.float16_groups, self.fp32_from_fp32_groups) for group in groups
                        for p in group], set_to_none)
            for run, _ in self._run_grads:
                run.grad = None
            return
        # The model params (where backward writes) and the main params (where the optimizer reads).
        zero_grads([p for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups)
                    for group in groups for p in group], set_to_none)

    def _copy_model_grads_to_main_grads(self) -> None:
        # Under the MegatronStrategy the fp32 grad is ``model_param.main_grad``, a view of the
        # GradBuffer: the main param's grad IS that view (no copy); with the flat step a run's grad is the
        # buffer's view over its elements. Used on its own, the 16-bit ``.grad`` is converted once and freed.
        if self._per_param_groups:
            for run, grad in self._run_grads:
                run.grad = grad
        else:
            for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
                for model_param, main_param in zip(model_group, main_group):
                    main_grad = self._main_grad_of(model_param)
                    if main_grad is not None:
                        main_param.grad = main_grad.float()  # the same tensor when fp32
                    else:
                        main_param.grad = None if model_param.grad is None else model_param.grad.float()
                    model_param.grad = None
        for group in self.fp32_from_fp32_groups:
            for param in group:
                main_grad = self._main_grad_of(param)
                if main_grad is not None:
                    param.grad = main_grad

    def _copy_main_params_to_model_params(self) -> None:
        # Round to nearest, once per step: one foreach call per group (no per-parameter Python in the step;
        # on an accelerator a few fused kernels instead of a launch per parameter). The step runs under no_grad.
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            if model_group:
                torch._foreach_copy_(model_group, main_group)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {
            "optimizer": self._inner_state_dict(),
            "grad_scaler": self._scaler_state(),
            "fp32_from_fp16_params": self.fp32_from_float16_groups,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if "fp32_from_fp16_params" not in state_dict:
            raise KeyError(
                "state_dict has no 'fp32_from_fp16_params': it was not written by "
                "Float16OptimizerWithFloat16Params (was the MegatronOptimizerCallback missing when it was saved?)"
            )
        saved_groups = state_dict["fp32_from_fp16_params"]
        if [len(g) for g in saved_groups] != [len(g) for g in self.fp32_from_float16_groups]:
            raise ValueError("fp32_from_fp16_params does not match this optimizer's parameter groups")
        self._load_inner_state_dict(state_dict["optimizer"])
        self._load_scaler_state(state_dict.get("grad_scaler"))
        for current_group, saved_group in zip(self.fp32_from_float16_groups, saved_groups):
            for current, saved in zip(current_group, saved_group):
                current.data.copy_(saved.data)

    def _inner_state_dict(self) -> dict[str, Any]:
        """The inner optimizer's ``state_dict()``; with the flat step in its per-parameter form (what it would be
        stepping a tensor per parameter: a state per main param, indexed in the groups' order)."""
        if not self._per_param_groups:
            return self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for group, params in zip(self.optimizer.param_groups, self._per_param_groups):
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(index, index + len(params)))})
            for i, p in enumerate(params, start=index):
                st = self.param_state(p)
                if st:  # each parameter its own scalars, as torch's: an optimizer increments a step in place
                    state[i] = {k: v.clone() if torch.is_tensor(v) and v.dim() == 0 else v for k, v in st.items()}
            index += len(params)
        return {"state": state, "param_groups": groups}

    def _load_inner_state_dict(self, saved: dict[str, Any]) -> None:
        """Load the inner optimizer's per-parameter ``state_dict()`` (:meth:`_inner_state_dict`'s form)."""
        if not self._per_param_groups:
            self.optimizer.load_state_dict(saved)
            return
        sizes = [len(g["params"]) for g in saved["param_groups"]]
        if sizes != [len(params) for params in self._per_param_groups]:
            raise ValueError(f"the saved optimizer state has groups of {sizes} parameters, this optimizer "
                             f"{[len(params) for params in self._per_param_groups]}")
        # As torch's load_state_dict: a step's scalar on the parameter's device for fused / capturable optimizers
        on_device = bool(self.optimizer.defaults.get("fused") or self.optimizer.defaults.get("capturable"))
        self.optimizer.state.clear()
        groups = zip(self.optimizer.param_groups, saved["param_groups"], self._per_param_groups)
        for group, saved_group, params in groups:
            group.update({k: v for k, v in saved_group.items() if k != "params"})
            for i, p in zip(saved_group["params"], params):
                if i in saved["state"]:
                    self.load_param_state(p, {k: v.to(p.device) if torch.is_tensor(v) and (v.dim() > 0 or on_device)
                                              else v for k, v in saved["state"][i].items()})
