"""Lightning callbacks that put Megatron's optimizer pieces into a Trainer."""

from __future__ import annotations

from lightning_megatron.callbacks.optimizer import MegatronOptimizerCallback
from lightning_megatron.callbacks.prediction_writer import PredictionWriter
from lightning_megatron.callbacks.progress import MegatronProgressBar
from lightning_megatron.callbacks.scheduler import OptimizerParamSchedulerCallback
from lightning_megatron.callbacks.summary import MegatronModelSummary
from lightning_megatron.callbacks.throughput import ThroughputCallback

__all__ = ["MegatronModelSummary", "MegatronOptimizerCallback", "MegatronProgressBar", "OptimizerParamSchedulerCallback",
           "PredictionWriter", "ThroughputCallback"]
