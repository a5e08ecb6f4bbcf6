"""bert-base bf16 at TP=1: ours against Hugging Face with the same allocator settings, side by side.

    .venv/bin/python benchmarks/hf_ratio.py [--rounds 3]

The rows of ``run.py`` that issue 39's "1.6x Hugging Face with the same allocator settings" reads, alone:
ours (bf16 params, fp32 main params through ``MegatronOptimizerCallback``, the CPU tuning) and
``BertForPreTraining`` under bf16 autocast in plain Lightning with the CPU tuning's glibc setting
(``hf-malloc``), seq 128, batch 8, each in a fresh process, alternating which goes first. Per round the
median step of 4 after 2 warm-up steps; prints both, the per-round ratio (HF step / ours) and the ratio of
the best rounds.
"""

from __future__ import annotations

import argparse
import json

from _common import SIZES, launch, median
from report import BATCH, SEQ


def run(rounds: int) -> dict:
    from bert_step import bert_rank

    steps: dict[str, list[float]] = {"ours": [], "hf-malloc": []}
    for r in range(rounds):
        for framework in (["ours", "hf-malloc"] if r % 2 == 0 else ["hf-malloc", "ours"]):
            spec = dict(framework=framework, precision="bf16", tp=1, pp=1, size=SIZES["base"].as_dict(), seq=SEQ,
                        batch=BATCH, micro_batch=BATCH, warmup=2, steps=4, profile=False)
            [rank] = launch(bert_rank, 1, spec, timeout=900)
            steps[framework].append(median(rank["step_times"]))
    ours, hf = steps["ours"], steps["hf-malloc"]
    return {"ours_s": [round(x, 3) for x in ours], "hf_malloc_s": [round(x, 3) for x in hf],
            "ratio_per_round": [round(h / o, 3) for o, h in zip(ours, hf)], "ratio_best": round(min(hf) / min(ours), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    print(json.dumps(run(parser.parse_args().rounds), indent=1))


if __name__ == "__main__":
    main()
