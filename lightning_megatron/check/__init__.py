"""``lightning-megatron check``: prove that a parallel layout trains like one process, predict memory and time.

- :func:`check_layouts` (:mod:`.parity`): fit a reference and other layouts for a few steps on the
  same samples and compare losses, gradient norms and every gradient as a global tensor;
- :mod:`.memory`: closed-form bytes per rank of parameters, gradients, optimizer state and
  activations for a layout (docs/memory.md);
- :mod:`.timing`: predicted step time, tokens/s and MFU of a layout from FLOPs, communication
  volumes and device rates (:mod:`.devices`: datasheet figures, or this machine measured), and on a GPU the
  host's dispatch of the ops :mod:`.host_ops` counts;
- :mod:`.cli`: the command line.
"""

from lightning_megatron.check.parity import CheckReport, LayoutResult, LayoutRun, Tolerances, check_layouts

__all__ = ["CheckReport", "LayoutResult", "LayoutRun", "Tolerances", "check_layouts"]
