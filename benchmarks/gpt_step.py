"""Our decoder against transformers' ``LlamaForCausalLM`` under plain Lightning, in the same run: tokens/s.

    python benchmarks/gpt_step.py [--size llama-tiny] [--repeats 3] [--precisions fp32,bf16] [--compile]
        [--out results.json]

Each measurement is a fresh spawned process (one rank, all cores) that runs ``warmup + steps``
training steps of ``Trainer.fit`` on synthetic full-length batches and times the steps after the
warm-up (data, forward, backward, optimizer, logging: what a user waits for). Ours and Hugging Face's
alternate, ``repeats`` times per precision, so drift of the machine hits both alike; the GEMM
ceiling of the same dtype is measured in the same run. Reported: median tokens/s of each, their
ratio, and the MFU of each against that ceiling (the decoder FLOP count of
:meth:`~lightning_megatron.models.gpt.module.GPTLightningModule.training_flops`, check's
:func:`lightning_megatron.cost.flops.model_flops`).

- ours: :class:`~lightning_megatron.models.gpt.module.GPTLightningModule` with the Llama shape
  (``llama_layer_spec``: RMSNorm, SwiGLU, rope, grouped-query attention, no biases, untied output
  layer), the MegatronStrategy on one process with the opt-in CPU tuning, torch AdamW; bf16 = bf16
  parameters with fp32 main params (MegatronOptimizerCallback) under ``precision="bf16-true"``.
- Hugging Face: ``LlamaForCausalLM`` (SDPA attention) of the same shape in a plain LightningModule,
  torch AdamW with the same weight-decay groups; bf16 = ``precision="bf16-mixed"`` (autocast, fp32
  params), what a user of plain Lightning writes.

Times measured while other jobs share the machine are contended: compare the ratio, not the times.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from _common import TokenBatches, launch, median, plain_lightning_causal_lm, set_threads, timed_fit

__all__ = ["LlamaSize", "SIZES", "gpt_rank"]

LR, WEIGHT_DECAY = 3e-4, 0.1


@dataclass(frozen=True, kw_only=True)
class LlamaSize:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int = 32000
    seq_length: int = 256
    batch: int = 8


SIZES = {s.name: s for s in (
    LlamaSize(name="llama-tiny", num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4,
              ffn_hidden_size=1376),
    LlamaSize(name="llama-small", num_layers=8, hidden_size=768, num_attention_heads=12, num_query_groups=4,
              ffn_hidden_size=2048, seq_length=512, batch=4),
)}




LLAMA_SHAPE = dict(position_embedding_type="rope", activation="silu", gated_linear_unit=True, add_bias_linear=False,
                   untie_embeddings_and_output_weights=True, layernorm_epsilon=1e-6, hidden_dropout=0.0,
                   attention_dropout=0.0, make_vocab_size_divisible_by=128)
"""GPTConfig fields of the Llama shape both decoder benchmarks build (transformers' defaults on its side)."""


def _ours(size: LlamaSize, bf16: bool, compile: bool = False, **config: Any):
    """Our Llama-shaped decoder of ``size``; ``config``: more GPTConfig fields (``defer_embedding_wgrad_compute``)."""
    from lightning_megatron.models.gpt import GPTConfig
    from lightning_megatron.models.gpt.module import GPTLightningModule

    return GPTLightningModule(GPTConfig(
        num_layers=size.num_layers, hidden_size=size.hidden_size, num_attention_heads=size.num_attention_heads,
        num_query_groups=size.num_query_groups, ffn_hidden_size=size.ffn_hidden_size, vocab_size=size.vocab_size,
        max_sequence_length=size.seq_length, spec="llama_layer_spec", **LLAMA_SHAPE,
        params_dtype="bfloat16" if bf16 else "float32", **config), lr=LR, weight_decay=WEIGHT_DECAY, compile=compile)


def _hf(size: LlamaSize):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=size.vocab_size, hidden_size=size.hidden_size,
                         intermediate_size=size.ffn_hidden_size, num_hidden_layers=size.num_layers,
                         num_attention_heads=size.num_attention_heads,
                         num_key_value_heads=size.num_query_groups, max_position_embeddings=size.seq_length,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")
    return plain_lightning_causal_lm(LlamaForCausalLM(config), LR, WEIGHT_DECAY)


def gpt_rank(run: dict[str, Any]) -> dict[str, Any]:
    """One training run in this (spawned) process: ``run`` = framework, size, precision, warmup, steps."""
    import warnings

    import torch.distributed as dist

    set_threads(dist.get_world_size())
    warnings.filterwarnings("ignore")
    size = LlamaSize(**run["size"])
    bf16, warmup, steps = run["precision"] == "bf16", run["warmup"], run["steps"]

    module = _ours(size, bf16, run.get("compile", False)) if run["framework"] == "ours" else _hf(size)
    times = timed_fit(run["framework"], module, bf16, TokenBatches((warmup + steps) * size.batch, size.seq_length,
                                                                   size.vocab_size), size.batch, warmup, steps)
    return {"step_s": times, "tokens_per_step": size.batch * size.seq_length}


def gpt_layout_rank(run: dict[str, Any]) -> dict[str, Any]:
    """Our decoder at one layout on this rank (``benchmarks/estimate_time.py --model llama-*|mixtral-*``): ``run`` =
    size, precision, warmup, steps, batch (rows per DP replica and step), micro_batch, strategy (MegatronStrategy's
    layout arguments); ``moe``: the size is ``moe_step``'s mixture of experts; ``folder`` and ``lora``: LoRA
    adapters of rank ``lora`` on every projection of the Llama saved in ``folder`` (its base frozen); ``config``:
    more GPTConfig fields of the decoder (``defer_embedding_wgrad_compute``)."""
    import warnings

    import torch.distributed as dist

    world = dist.get_world_size()
    threads = set_threads(world)
    warnings.filterwarnings("ignore")
    bf16, warmup, steps = run["precision"] == "bf16", run["warmup"], run["steps"]
    if run.get("moe"):
        from moe_step import MixtralSize
        from moe_step import _ours as moe_module

        size: Any = MixtralSize(**run["size"])
        module = moe_module(size, bf16)
    elif run.get("folder"):
        from lightning_megatron.models.gpt.module import GPTLightningModule

        size = LlamaSize(**run["size"])
        r = run["lora"]
        module = GPTLightningModule.from_pretrained(
            run["folder"], lora={"rank": r, "alpha": 2.0 * r, "dropout": 0.0}, lr=LR, weight_decay=WEIGHT_DECAY,
            config={"hidden_dropout": 0.0, "attention_dropout": 0.0, "params_dtype": "bfloat16" if bf16 else "float32"})
    else:
        size = LlamaSize(**run["size"])
        module = _ours(size, bf16, **run.get("config", {}))
    data = TokenBatches((warmup + steps) * run["batch"], size.seq_length, size.vocab_size)
    times = timed_fit("ours", module, bf16, data, run["batch"], warmup, steps, devices=world,
                      micro_batch=run["micro_batch"], **run["strategy"])
    return {"step_times": times, "threads": threads}


def _flops(size: LlamaSize) -> float:
    from lightning_megatron.flops import transformer_flops

    d = size.hidden_size // size.num_attention_heads
    tokens = size.batch * size.seq_length
    return transformer_flops(num_layers=size.num_layers, hidden_size=size.hidden_size,
                             ffn_hidden_size=size.ffn_hidden_size, seq_length=size.seq_length, tokens=tokens,
                             head_tokens=tokens, vocab_size=size.vocab_size, head_dense=False,
                             query_projection_size=size.num_attention_heads * d,
                             kv_projection_size=size.num_query_groups * d, gated_linear_unit=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from gemm import gemm_rank

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="llama-tiny", choices=sorted(SIZES))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compile", action="store_true",
                        help="ours with compile=True (its layers and loss; the warm-up steps compile)")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    precisions = args.precisions.split(",")
    [gemm] = launch(gemm_rank, 1, [2048], precisions, [torch.get_num_threads()], timeout=600)
    ceiling = {row["dtype"]: row["flops_per_s"] for row in gemm}
    flops = _flops(size)
    report: dict[str, Any] = {"size": asdict(size), "gemm_flops_per_s": ceiling, "step_flops": flops, "runs": {}}
    for precision in precisions:
        tokens_per_s: dict[str, list[float]] = {"ours": [], "hf": []}
        for _ in range(args.repeats):
            for framework in ("ours", "hf"):
                run = {"framework": framework, "size": asdict(size), "precision": precision,
                       "warmup": args.warmup, "steps": args.steps, "compile": args.compile}
                [r] = launch(gpt_rank, 1, run, timeout=1800)
                tokens_per_s[framework].append(r["tokens_per_step"] / median(r["step_s"]))
        row = {k: median(v) for k, v in tokens_per_s.items()}
        row["ratio"] = row["ours"] / row["hf"]
        row["mfu"] = {k: row[k] / (size.batch * size.seq_length) * flops / ceiling[precision] for k in ("ours", "hf")}
        row["all"] = tokens_per_s
        report["runs"][precision] = row
        print(f"{size.name} {precision}: ours {row['ours']:.0f} tokens/s, LlamaForCausalLM {row['hf']:.0f} tokens/s, "
              f"ratio {row['ratio']:.2f}x; MFU ours {row['mfu']['ours']:.2f}, hf {row['mfu']['hf']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
