"""Context parallelism on this machine: tokens/s of a decoder's forward + backward at CP=2 against CP=1 at the
same sequence length, and the time the CP exchanges take (exposed: gloo's collectives are synchronous).

A Llama-shaped decoder (RMSNorm, rope, SwiGLU, grouped-query attention), micro batch 1, fp32, one thread per
rank: CP=1 is one process, CP=2 two processes of one thread each, the sequence split in megatron-core's
load-balanced order (``transformer/context_parallel.py``) with ``cp_comm_type`` all_gather, a2a or p2p. Each
configuration: 1 warm-up step, then the best of ``--steps``. The exchanges are timed by wrapping the all-gather,
reduce-scatter and all-to-all the attention calls (forward and backward). Memory: the peak bytes autograd saves
for backward per rank.

Run: ``PYTHONPATH=. python benchmarks/context_parallel.py --seq 2048,4096,8192``. Prints a table and one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world: int, port: int, args, queue) -> None:  # pragma: no cover (child)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import lightning_megatron.tensor_parallel.mappings as mappings
    import lightning_megatron.transformer.context_parallel as cpm
    from lightning_megatron.models.gpt.model import GPTModel, gpt_loss
    from lightning_megatron.transformer import TransformerConfig

    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[0] += time.perf_counter() - t0
            return out
        return wrapper

    mappings._gather_along_dim = timed(mappings._gather_along_dim)
    mappings._reduce_scatter_along_first_dim = timed(mappings._reduce_scatter_along_first_dim)
    cpm._all_to_all = timed(cpm._all_to_all)
    if args.comm == "p2p":  # the ring: the waits for each posted exchange, and the gradients' all-to-all

        class _Timed:
            def __init__(self, work):
                self.work = work

            def wait(self):
                return timed(self.work.wait)()

        post = dist.batch_isend_irecv
        dist.batch_isend_irecv = lambda ops: [_Timed(w) for w in post(ops)]
        dist.all_to_all_single = timed(dist.all_to_all_single)
    results = []
    for seq in args.seq:
        config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                                   num_query_groups=args.groups, ffn_hidden_size=args.ffn, gated_linear_unit=True,
                                   activation="silu", add_bias_linear=False, normalization="RMSNorm",
                                   hidden_dropout=0.0, attention_dropout=0.0, cp_comm_type=args.comm,
                                   attention_backend="sdpa")
        torch.manual_seed(0)
        model = GPTModel(config, "llama_layer_spec", args.vocab, seq, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        tokens = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(1))
        batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": torch.ones(1, seq)}
        context = None
        if world > 1:
            batch, context = cpm.split_batch(batch, dist.group.WORLD, rank)
        saved = [0]

        def step() -> None:
            sizes: dict[int, int] = {}

            def pack(t):
                sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(batch["tokens"], batch.get("position_ids"), labels=batch["labels"], context_parallel=context)
                loss = gpt_loss(out, batch["loss_mask"])
            saved[0] = sum(sizes.values())
            loss.backward()
            model.zero_grad(set_to_none=True)

        step()
        best, exchange = float("inf"), 0.0
        for _ in range(args.steps):
            dist.barrier()
            spent[0] = 0.0
            t0 = time.perf_counter()
            step()
            elapsed = time.perf_counter() - t0
            if elapsed < best:
                best, exchange = elapsed, spent[0]
        times = [None] * world
        dist.all_gather_object(times, (best, exchange, saved[0]))
        slowest = max(t[0] for t in times)
        results.append({"seq": seq, "cp": world, "step_s": slowest, "tokens_per_s": seq / slowest,
                        "exchange_s": max(t[1] for t in times), "saved_mib": max(t[2] for t in times) / 2**20})
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure(world: int, args) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_run, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = queue.get(timeout=3600)
    for p in procs:
        p.join(timeout=60)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--comm", choices=("all_gather", "a2a", "p2p"), default="all_gather")
    args = parser.parse_args(argv)
    one, two = measure(1, args), measure(2, args)
    print(f"decoder {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.groups} kv groups, "
          f"micro batch 1, fp32, 1 thread per rank, cp_comm_type={args.comm}")
    print(f"{'seq':>6} {'CP=1 tok/s':>11} {'CP=2 tok/s':>11} {'speed-up':>9} {'exchange s':>11} {'of step':>8} "
          f"{'saved MiB CP=1':>15} {'CP=2':>8}")
    for a, b in zip(one, two):
        print(f"{a['seq']:>6} {a['tokens_per_s']:>11.0f} {b['tokens_per_s']:>11.0f} "
              f"{b['tokens_per_s'] / a['tokens_per_s']:>9.2f} {b['exchange_s']:>11.4f} "
              f"{b['exchange_s'] / b['step_s']:>8.1%} {a['saved_mib']:>15.1f} {b['saved_mib']:>8.1f}")
    print(json.dumps({"args": vars(args), "cp1": one, "cp2": two}))


if __name__ == "__main__":
    main()
