"""Our mixture-of-experts decoder against transformers' ``MixtralForCausalLM`` under plain Lightning: tokens/s.

    python benchmarks/moe_step.py [--size mixtral-tiny] [--repeats 3] [--precisions fp32,bf16] [--skip-ep]
                                  [--out results.json]        (--precisions "": the EP part only)

mixtral-tiny: 4 layers, h 256, 4 heads in 2 key/value groups, 8 experts of SwiGLU width 512, top 2, vocab
32000, 4 x 256 tokens per step (29.8 M parameters, 16.4 M of them the embedding and the output layer).

Each measurement is a fresh spawned process that runs ``warmup + steps`` training steps of
``Trainer.fit`` on synthetic full-length batches and times the steps after the warm-up (data, forward,
backward, optimizer, logging: what a user waits for), as ``benchmarks/gpt_step.py`` does for the dense
decoder. Ours and Hugging Face's alternate, ``repeats`` times per precision, so drift of the machine
hits both alike. Reported: median tokens/s of each and their ratio ours / HF.

- ours: :class:`~lightning_megatron.models.gpt.module.GPTLightningModule` with ``llama_moe_layer_spec``
  (RMSNorm, rope, grouped-query attention, SwiGLU experts, untied output layer; ``num_moe_experts``
  experts, top ``moe_router_topk``, ``moe_aux_loss_coeff`` 0.01, the ``alltoall`` dispatcher), the
  MegatronStrategy on one process with the opt-in CPU tuning, torch AdamW; bf16 = bf16 parameters
  with fp32 main params (MegatronOptimizerCallback) under ``precision="bf16-true"``.
- Hugging Face: ``MixtralForCausalLM`` (SDPA attention, transformers' default experts implementation)
  of the same shape in a plain LightningModule, ``output_router_logits=True`` and
  ``router_aux_loss_coef`` 0.01 so it computes its load-balancing loss too; torch AdamW with the same
  weight-decay groups; bf16 = ``precision="bf16-mixed"`` (autocast, fp32 params).
- EP (``--skip-ep`` leaves it out): ours in fp32 at ``expert_model_parallel_size=2`` on 2 processes
  (attention data-parallel, 4 of the 8 experts per rank, tokens exchanged by all-to-all) against 1
  process, the same global batch (half per rank at EP=2, each rank its own samples); the step time of
  EP=2 is the slowest rank's. Every process gets an equal share of the cores (``set_threads``), so on
  a 2-core machine this compares 2 processes x 1 thread with 1 process x 2 threads more than it
  measures expert parallelism.

The two aux losses are not the same number (transformers' pools the layers and does not divide by
``k``; docs/moe.md), which does not matter for the time. Times measured while other jobs share the
machine are contended: compare the ratio, not the times.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from _common import TokenBatches, launch, median, plain_lightning_causal_lm, set_threads, timed_fit
from gpt_step import LLAMA_SHAPE

__all__ = ["MixtralSize", "SIZES", "moe_rank"]

LR, WEIGHT_DECAY, AUX_LOSS_COEFF = 3e-4, 0.1, 0.01


@dataclass(frozen=True, kw_only=True)
class MixtralSize:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    num_experts: int
    topk: int
    expert_ffn_hidden_size: int
    vocab_size: int = 32000
    seq_length: int = 256
    batch: int = 4


SIZES = {s.name: s for s in (
    MixtralSize(name="mixtral-tiny", num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                num_experts=8, topk=2, expert_ffn_hidden_size=512),
)}




def _ours(size: MixtralSize, bf16: bool):
    from lightning_megatron.models.gpt import GPTConfig
    from lightning_megatron.models.gpt.module import GPTLightningModule

    return GPTLightningModule(GPTConfig(
        num_layers=size.num_layers, hidden_size=size.hidden_size, num_attention_heads=size.num_attention_heads,
        num_query_groups=size.num_query_groups, ffn_hidden_size=size.expert_ffn_hidden_size,
        vocab_size=size.vocab_size, max_sequence_length=size.seq_length, spec="llama_moe_layer_spec",
        num_moe_experts=size.num_experts, moe_router_topk=size.topk, moe_aux_loss_coeff=AUX_LOSS_COEFF,
        moe_token_dispatcher_type="alltoall", **LLAMA_SHAPE,
        params_dtype="bfloat16" if bf16 else "float32"), lr=LR, weight_decay=WEIGHT_DECAY)


def _hf(size: MixtralSize):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=size.vocab_size, hidden_size=size.hidden_size,
                           intermediate_size=size.expert_ffn_hidden_size, num_hidden_layers=size.num_layers,
                           num_attention_heads=size.num_attention_heads,
                           num_key_value_heads=size.num_query_groups, max_position_embeddings=size.seq_length,
                           num_local_experts=size.num_experts, num_experts_per_tok=size.topk,
                           output_router_logits=True, router_aux_loss_coef=AUX_LOSS_COEFF,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")
    return plain_lightning_causal_lm(MixtralForCausalLM(config), LR, WEIGHT_DECAY)


def moe_rank(run: dict[str, Any]) -> dict[str, Any]:
    """One training run on this (spawned) rank: ``run`` = framework, size, precision, ep, warmup, steps.

    ``size.batch`` is the global batch; at ``ep`` > 1 every rank reads ``batch / world`` samples of its own."""
    import warnings

    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    threads = set_threads(world)
    warnings.filterwarnings("ignore")
    size = MixtralSize(**run["size"])
    bf16, warmup, steps, ep = run["precision"] == "bf16", run["warmup"], run["steps"], run.get("ep", 1)
    if size.batch % world:
        raise ValueError(f"batch {size.batch} is not divisible by the {world} ranks")
    batch = size.batch // world
    n = (warmup + steps) * batch
    module = _ours(size, bf16) if run["framework"] == "ours" else _hf(size)
    times = timed_fit(run["framework"], module, bf16, TokenBatches(n, size.seq_length, size.vocab_size, offset=rank * n),
                      batch, warmup, steps, devices=world, expert_model_parallel_size=ep)
    return {"step_s": times, "tokens_per_step": size.batch * size.seq_length, "threads": threads,
            "params": sum(p.numel() for p in module.parameters())}


def _load() -> float:
    """The 1-minute load average: other jobs show up here (the run itself adds about its threads, 2)."""
    return round(os.getloadavg()[0], 2)


def _tokens_per_s(ranks: list[dict[str, Any]]) -> float:
    """Global tokens per step over the median step time, a step lasting as long as its slowest rank."""
    steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    return ranks[0]["tokens_per_step"] / median(steps)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="mixtral-tiny", choices=sorted(SIZES))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-ep", action="store_true", help="leave out the EP=2 against EP=1 comparison")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step's end starts the clock)")
    size = SIZES[args.size]
    report: dict[str, Any] = {"size": asdict(size), "warmup": args.warmup, "steps": args.steps,
                              "repeats": args.repeats, "load_before": _load(), "runs": {}}
    t_start = time.perf_counter()
    for precision in [p for p in args.precisions.split(",") if p]:  # "" : the EP part only
        tokens_per_s: dict[str, list[float]] = {"ours": [], "hf": []}
        params: dict[str, int] = {}
        load: dict[str, list[float]] = {"ours": [], "hf": []}
        for _ in range(args.repeats):
            for framework in ("ours", "hf"):
                run = {"framework": framework, "size": asdict(size), "precision": precision,
                       "warmup": args.warmup, "steps": args.steps}
                ranks = launch(moe_rank, 1, run, timeout=1800)
                tokens_per_s[framework].append(_tokens_per_s(ranks))
                params[framework] = ranks[0]["params"]
                load[framework].append(_load())
        row: dict[str, Any] = {k: median(v) for k, v in tokens_per_s.items()}
        row["ratio"] = row["ours"] / row["hf"]
        row["all"], row["params"], row["load_after"] = tokens_per_s, params, load
        report["runs"][precision] = row
        print(f"{size.name} {precision}: ours {row['ours']:.0f} tokens/s, MixtralForCausalLM {row['hf']:.0f} "
              f"tokens/s, ratio {row['ratio']:.2f}x (params ours {params['ours']:,}, hf {params['hf']:,})",
              flush=True)
    if not args.skip_ep:
        tokens_per_s = {"ep1": [], "ep2": []}
        load = {"ep1": [], "ep2": []}
        for r in range(args.repeats):
            for name in (("ep1", "ep2") if r % 2 == 0 else ("ep2", "ep1")):
                ep = int(name[2:])
                run = {"framework": "ours", "size": asdict(size), "precision": "fp32", "ep": ep,
                       "warmup": args.warmup, "steps": args.steps}
                tokens_per_s[name].append(_tokens_per_s(launch(moe_rank, ep, run, timeout=1800)))
                load[name].append(_load())
        row = {k: median(v) for k, v in tokens_per_s.items()}
        row["ratio"] = row["ep2"] / row["ep1"]
        row["all"], row["load_after"] = tokens_per_s, load
        report["ep"] = row
        print(f"{size.name} fp32 ours: EP=1 (1 process) {row['ep1']:.0f} tokens/s, EP=2 (2 processes) "
              f"{row['ep2']:.0f} tokens/s, ratio EP=2/EP=1 {row['ratio']:.2f}x", flush=True)
    report["wall_s"] = time.perf_counter() - t_start
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
