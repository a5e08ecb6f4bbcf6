"""Loss scalers for fp16 training, with Megatron's names and update rule.

fp16 has 10 mantissa bits and a smallest normal of ~6e-5: small gradients underflow to zero in the
backward pass. Multiplying the loss by ``scale`` before ``backward`` shifts every gradient up by
the same factor (the chain rule is linear); the optimizer multiplies the fp32 main grads by
``inv_scale = 1 / scale`` before using them. A scale that is too large overflows to inf/nan; the
dynamic scaler detects that (the optimizer skips the step) and backs off.

The scale is a one-element fp32 tensor so that ``loss * scale`` stays on the loss's device and in
the autograd graph; :meth:`MegatronGradScaler.to` moves it next to the parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

__all__ = ["MegatronGradScaler", "ConstantGradScaler", "DynamicGradScaler"]


class MegatronGradScaler(ABC):
    """A loss scale and its update rule: ``scale``, ``inv_scale``, ``update(found_inf)``."""

    def __init__(self, initial_scale: float) -> None:
        if not initial_scale > 0.0:
            raise ValueError(f"initial_scale={initial_scale!r} must be > 0 (2**16 is a usual fp16 start)")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale, a ``[1]`` fp32 tensor."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale``, computed in fp64 and stored in fp32 so that powers of two stay exact."""
        return self._scale.double().reciprocal().float()

    def to(self, device: torch.device | str) -> MegatronGradScaler:
        """Move the scale (and any other tensors) to ``device``; returns ``self``."""
        self._scale = self._scale.to(device)
        return self

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Advance the scaler after a step; ``found_inf`` is true when some grad was inf or nan."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (``--loss-scale`` in Megatron). The wrapper skips an overflowing step (as megatron-core's
    ``MixedPrecisionOptimizer`` does), but the strategy's guard, ``check_for_nan_in_loss_and_grad`` (on by default),
    stops the run at a non-finite gradient first: only the dynamic scaler's overflows are skipped then
    (docs/optimizer.md, "Loss scaling")."""

    def __init__(self, initial_scale: float) -> None:
        super().__init__(initial_scale)
        self.constant = float(initial_scale)
        """The scale as a host number (it never changes): what the optimizer tests without reading the device."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scale with hysteresis.

    Update rule for one step (``found_inf`` agreed on by all model-parallel ranks):

    - overflow: ``growth_tracker = 0``; ``hysteresis_tracker -= 1``; if ``hysteresis_tracker <= 0``:
      ``scale = max(scale * backoff_factor, min_scale)``. So the first ``hysteresis - 1`` overflows
      after a growth only skip the step; later ones also shrink the scale, every time.
    - clean step: ``growth_tracker += 1``; when it reaches ``growth_interval`` it resets to 0, the
      hysteresis tracker resets to ``hysteresis`` and ``scale *= growth_factor``. A clean step does
      not reset the hysteresis tracker by itself.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ) -> None:
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(
                f"min_scale={min_scale!r} must satisfy 0 < min_scale <= initial_scale={initial_scale!r}"
            )
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor={growth_factor!r} must be > 1 (Megatron uses 2.0)")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor!r} must be in (0, 1) (Megatron uses 0.5)")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval!r} must be a positive integer (e.g. 1000)")
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis={hysteresis!r} must be a positive integer (Megatron uses 2)")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def to(self, device: torch.device | str) -> DynamicGradScaler:
        super().to(device)
        self.min_scale = self.min_scale.to(device)
        self.growth_factor = self.growth_factor.to(device)
        self.backoff_factor = self.backoff_factor.to(device)
        return self

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Keep the scale where this scaler lives, whatever device the checkpoint was saved from.
        self._scale = state_dict["scale"].to(device=self._scale.device, dtype=torch.float32).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
