"""One BERT pretraining run per call, inside a spawned rank: ours (MegatronStrategy) or Hugging Face.

:func:`bert_rank` runs ``warmup + steps`` training steps of ``Trainer.fit`` on synthetic batches
(every sequence full length, 15% of tokens masked) and returns, for this rank:

- ``step_times``: seconds between consecutive ``on_train_batch_end`` calls after the warm-up
  (everything a user waits for: data, forward, backward, collectives, optimizer, logging), and
  ``step_cpu``, the CPU seconds (user + system, all threads) this rank used in each;
- ``max_rss`` (``getrusage`` high-water after the timed steps) and ``rss_before_model``;
- ``state_bytes``: params, grads and optimizer state held after an optimizer step, summed from the
  tensors themselves (each storage once: a tied weight is counted once, fp32 main params included);
- with ``profile``: one more step under ``torch.profiler``: its wall time, the time inside
  collectives and point-to-point transfers, and the top ops by self CPU time;
- with ``trace``: the last timed step's schedule events (``strategy.schedule_trace``): ``busy_s``,
  the time in forward and backward passes, and ``trace_step_s``, that step's wall time.

``run["vp"]`` and ``run["overlap_p2p_comm"]`` (ours) set the interleaved schedule and its p2p overlap,
``run["model_kwargs"]`` extra ``BertConfig`` fields (e.g. ``num_layers_in_last_pipeline_stage``).

Ours: :class:`BertLightningModule` with the post-norm spec (Hugging Face's layout), the
MegatronStrategy, torch AdamW; bf16 = bf16 parameters with :class:`MegatronOptimizerCallback`
(fp32 main params, no clipping) under ``precision="bf16-true"``. ``optimizer_stepped`` in the
result tells whether AdamW really updated the parameters (a guard against timing a step that
updates nothing).
Hugging Face: ``BertForPreTraining`` (SDPA attention) in a plain LightningModule, torch AdamW with
the same weight-decay groups; bf16 = ``precision="bf16-mixed"`` (autocast, fp32 params).
"hf-malloc": the same, with the glibc malloc settings of :mod:`lightning_megatron.cpu.allocator`.

Ours opts in to the CPU tuning explicitly (:class:`lightning_megatron.cpu.CPUTuning`, all pieces on);
``run["cpu_tuning"]`` switches pieces off for A/B runs (a dict of CPUTuning fields, e.g.
``{"shared_memory_collectives": False}``; ``None``: no tuning at all, the library's default path).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import torch

from _common import BertSize, current_rss_bytes, max_rss_bytes, set_threads

__all__ = ["bert_rank", "SyntheticBatches", "collective_time"]

MASK_FRACTION = 0.15
LR = 1e-4
WEIGHT_DECAY = 0.01

# Names of collective and point-to-point ops in torch.profiler traces (gloo and c10d spellings).
_COLLECTIVE_MARKERS = ("gloo:", "c10d::", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                       "broadcast", "send", "recv", "barrier")


class SyntheticBatches(torch.utils.data.Dataset):
    """Deterministic full-length BERT samples in our batch format."""

    def __init__(self, num_samples: int, seq: int, vocab: int, seed: int = 0) -> None:
        self.num_samples, self.seq, self.vocab, self.seed = num_samples, seq, vocab, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        s = self.seq
        tokens = torch.randint(1000, self.vocab, (s,), generator=g)
        n_masked = max(1, int(MASK_FRACTION * s))
        positions = torch.randperm(s - 1, generator=g)[:n_masked] + 1
        lm_labels = torch.full((s,), -100)
        lm_labels[positions] = tokens[positions]
        tokens[positions] = 103  # [MASK]
        loss_mask = torch.zeros(s)
        loss_mask[positions] = 1.0
        return {"tokens": tokens, "token_types": (torch.arange(s) >= s // 2).long(),
                "attention_mask": torch.ones(s, dtype=torch.long), "lm_labels": lm_labels, "loss_mask": loss_mask,
                "binary_labels": torch.randint(0, 2, (), generator=g)}


def _hf_module(size: BertSize, seq: int):
    from lightning.pytorch import LightningModule
    from transformers import BertConfig, BertForPreTraining

    class HFBertPretraining(LightningModule):
        """Plain Lightning around BertForPreTraining: what a user would write."""

        def __init__(self) -> None:
            super().__init__()
            config = BertConfig(vocab_size=size.vocab_size, hidden_size=size.hidden_size,
                                num_hidden_layers=size.num_layers, num_attention_heads=size.num_attention_heads,
                                intermediate_size=size.ffn_hidden_size,
                                max_position_embeddings=size.max_position_embeddings,
                                type_vocab_size=size.type_vocab_size, attn_implementation="sdpa")
            self.model = BertForPreTraining(config)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            out = self.model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"],
                             token_type_ids=batch["token_types"], labels=batch["lm_labels"],
                             next_sentence_label=batch["binary_labels"])
            self.log("loss", out.loss.detach(), prog_bar=True)
            return out.loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            decay, no_decay = [], []
            for name, p in self.model.named_parameters():
                (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
            return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=LR)

    return HFBertPretraining()


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _ours_module(size: BertSize, bf16: bool, **config_fields: Any):
    from lightning_megatron.models.bert import BertConfig
    from lightning_megatron.models.bert.module import BertLightningModule

    return BertLightningModule(BertConfig(
        num_layers=size.num_layers, hidden_size=size.hidden_size, num_attention_heads=size.num_attention_heads,
        ffn_hidden_size=size.ffn_hidden_size, vocab_size=size.vocab_size,
        max_sequence_length=size.max_position_embeddings, spec="bert_layer_post_norm_spec",
        params_dtype="bfloat16" if bf16 else "float32", **config_fields), lr=LR, weight_decay=WEIGHT_DECAY)


def _optimizer_stepped(optimizers: list[Any]) -> bool:
    """True when the optimizer holds state, i.e. it has updated at least one parameter."""
    return any(len(getattr(opt, "optimizer", opt).state) > 0 for opt in optimizers)


def _state_bytes(module: torch.nn.Module, optimizers: list[Any]) -> dict[str, int]:
    """Bytes of params, grads and optimizer state now alive, each storage counted once."""
    seen: set[int] = set()

    def nbytes(t: torch.Tensor | None) -> int:
        if t is None or not torch.is_tensor(t):
            return 0
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    params = list(module.parameters())
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        params += [p for group in inner.param_groups for p in group["params"]]  # fp32 main params
    out = {"params": sum(nbytes(p) for p in params)}
    out["grads"] = sum(nbytes(p.grad) for p in params)
    optim = 0
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            optim += sum(nbytes(v) for v in state.values())
    out["optimizer"] = optim
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def collective_time(prof: Any) -> tuple[float, dict[str, float]]:
    """Seconds the main thread spent in collectives / p2p ops (outermost such events only)."""
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    if not events:
        return 0.0, {}
    main_thread = max({e.thread for e in events}, key=lambda t: sum(e.cpu_time_total for e in events
                                                                   if e.thread == t and e.cpu_parent is None))

    def is_comm(e: Any) -> bool:
        name = e.name.lower()
        return any(m in name for m in _COLLECTIVE_MARKERS)

    total, by_name = 0.0, {}
    for e in events:
        if e.thread != main_thread or not is_comm(e):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if is_comm(parent):
                nested = True
                break
            parent = parent.cpu_parent
        if nested:
            continue
        seconds = e.cpu_time_total / 1e6
        total += seconds
        by_name[e.name] = by_name.get(e.name, 0.0) + seconds
    return total, by_name


def _top_ops(prof: Any, n: int = 25) -> list[dict[str, Any]]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"name": e.key, "self_s": e.self_cpu_time_total / 1e6, "total_s": e.cpu_time_total / 1e6,
             "calls": e.count} for e in rows]


def bert_rank(run: dict[str, Any]) -> dict[str, Any]:
    """One training run on this rank; ``run`` = framework, size, precision, tp, pp, batch, seq, ... ."""
    import torch.distributed as dist

    world = dist.get_world_size()
    threads = set_threads(world)
    import warnings

    warnings.filterwarnings("ignore")
    from lightning.pytorch import Callback, Trainer

    size = BertSize(**run["size"])
    warmup, steps, profile = run["warmup"], run["steps"], run.get("profile", False)
    timed_end = warmup + steps  # batches [warmup, timed_end) are timed
    max_steps = timed_end + (1 if profile else 0)
    bf16 = run["precision"] == "bf16"
    result: dict[str, Any] = {"rank": dist.get_rank(), "threads": threads}

    class Probe(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.cpu: list[float] = []
            self.prof: Any = None
            self.trace: list = []
            self.t_trace = 0.0
            self.t_prof = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if run.get("trace") and batch_idx == timed_end - 1:  # the schedule's events of the last timed step
                trainer.strategy.schedule_trace = self.trace = []
                self.t_trace = time.perf_counter()
            if profile and batch_idx == timed_end:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()
                self.t_prof = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            if batch_idx < timed_end:
                self.stamps.append(now)
                self.cpu.append(_cpu_seconds())
            if batch_idx == timed_end - 1:
                if run.get("trace"):  # busy = forward/backward passes; the rest of the step: p2p, bubble, optimizer
                    trainer.strategy.schedule_trace = None
                    result["trace_step_s"] = now - self.t_trace
                    result["trace_window"] = (self.t_trace, now)
                    result["busy_s"] = sum(e.end - e.start for e in self.trace)
                    result["events"] = [(e.kind, e.microbatch, e.chunk, e.start - self.t_trace, e.end - self.t_trace)
                                        for e in self.trace]
                result["max_rss"] = max_rss_bytes()
                result["state_bytes"] = _state_bytes(pl_module, trainer.strategy.optimizers)
                result["num_threads_in_step"] = torch.get_num_threads()
                result["optimizer_stepped"] = _optimizer_stepped(trainer.strategy.optimizers)
            if self.prof is not None and batch_idx == timed_end:
                self.prof.__exit__(None, None, None)
                result["profile_step_s"] = now - self.t_prof
                comm, by_name = collective_time(self.prof)
                result["comm_s"], result["comm_by_name"] = comm, by_name
                result["top_ops"] = _top_ops(self.prof)
                self.prof = None

    if run["framework"] == "hf-malloc":  # HF with the allocator settings of our CPU tuning
        from lightning_megatron.cpu.allocator import keep_freed_memory

        keep_freed_memory()
    result["rss_before_model"] = current_rss_bytes()
    probe = Probe()
    callbacks: list[Any] = [probe]
    if run["framework"] == "ours":
        from lightning_megatron.cpu import CPUTuning
        from lightning_megatron.strategy import MegatronStrategy

        tuning = run.get("cpu_tuning", {})
        strategy: Any = MegatronStrategy(tensor_model_parallel_size=run["tp"], pipeline_model_parallel_size=run["pp"],
                                         virtual_pipeline_model_parallel_size=run.get("vp"),
                                         micro_batch_size=run["micro_batch"], sequence_parallel=run.get("sp", False),
                                         cpu_tuning=None if tuning is None else CPUTuning(**tuning))
        module: Any = _ours_module(size, bf16, **run.get("model_kwargs", {}))
        strategy.overlap_p2p_comm = run.get("overlap_p2p_comm", True)  # read by the strategy's setup
        precision = "32-true"
        if bf16:
            precision = "bf16-true"
            if run.get("main_params", True):
                from lightning_megatron.callbacks import MegatronOptimizerCallback
                from lightning_megatron.optimizer import OptimizerConfig

                callbacks.append(MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.0,
                                                           use_distributed_optimizer=run.get("zero1", False))))
        elif run.get("zero1", False):  # fp32 with the distributed optimizer (ZeRO-1)
            from lightning_megatron.callbacks import MegatronOptimizerCallback
            from lightning_megatron.optimizer import OptimizerConfig

            callbacks.append(MegatronOptimizerCallback(OptimizerConfig(clip_grad=0.0, use_distributed_optimizer=True)))
    else:
        strategy, module = "auto", _hf_module(size, run["seq"])
        precision = "bf16-mixed" if bf16 else "32-true"
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, precision=precision, max_steps=max_steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      use_distributed_sampler=False, callbacks=callbacks)
    data = torch.utils.data.DataLoader(SyntheticBatches(max_steps * run["batch"], run["seq"], size.vocab_size),
                                       batch_size=run["batch"], shuffle=False)
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=data)
    result["fit_s"] = time.perf_counter() - t0
    stamps = probe.stamps
    if warmup < 1:
        raise ValueError("bert_rank: warmup must be >= 1 (the first step's end starts the clock)")
    result["step_times"] = [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])]
    result["step_cpu"] = [b - a for a, b in zip(probe.cpu[warmup - 1:], probe.cpu[warmup:])]
    result["pid"] = os.getpid()
    return result
