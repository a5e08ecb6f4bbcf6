"""The GPT dataset's indices at pretraining scale: 2.56e8 samples of 2048 tokens.

    PYTHONPATH=. .venv/bin/python benchmarks/gpt_index.py [--samples 256000000] [--json out.json]

The corpus is the one the BERT samples-mapping benchmark uses (``benchmarks/data.py:
synthetic_corpus``: 64,636 documents of log-normal length, 59 M tokens), each document one GPT
document. 2.56e8 samples x 2048 tokens (the large recipe's 1,000,000 steps x 256) need about 8,900
epochs of it: a document index of 5.7e8 entries, a sample index of 2.56e8 rows, a shuffle of 2.56e8.
Each measurement runs in a fresh process (peak RSS: its ``getrusage`` high-water mark): a cold build
into an empty cache directory, then a warm start that memory-maps the files. The machine may be
shared: the load average is recorded with each run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SEQ_LENGTH = 2048
SEED = 1234
NUM_SAMPLES = 256_000_000


def _job(num_samples: int, seq_length: int, cache_dir: str) -> dict[str, Any]:
    import numpy as np

    from data import synthetic_corpus
    from lightning_megatron.data.gpt_dataset import cached_gpt_indices

    sizes, doc_idx = synthetic_corpus()
    ends = np.r_[0, np.cumsum(sizes, dtype=np.int64)]
    lengths = np.diff(ends[doc_idx])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss_before, cpu_before = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    document_index, sample_index, shuffle_index = cached_gpt_indices(
        lengths, seq_length=seq_length, seed=SEED, num_samples=num_samples, cache_dir=cache_dir, name="bench")
    k = int(shuffle_index[-1])  # touch the maps: the start is complete
    checksum = int(sample_index[k, 0]) + int(document_index[-1])
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"num_samples": num_samples, "seq_length": seq_length, "seconds": seconds,
            "cpu_seconds": usage.ru_utime + usage.ru_stime - cpu_before, "peak_rss": usage.ru_maxrss * 1024,
            "baseline_rss": rss_before * 1024, "checksum": checksum,
            "load_average": (load_before + os.getloadavg()[0]) / 2,
            "documents": int(len(lengths)), "tokens": int(lengths.sum()),
            "bytes": {"document": int(document_index.nbytes), "sample": int(sample_index.nbytes),
                      "shuffle": int(shuffle_index.nbytes)}}


def _fresh(*args: Any) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_job, *args).result()


def run(num_samples: int = NUM_SAMPLES, seq_length: int = SEQ_LENGTH) -> dict[str, Any]:
    cache = tempfile.mkdtemp(prefix="lm-bench-gpt-")
    try:
        cold = _fresh(num_samples, seq_length, cache)
        print(json.dumps({"cold": cold}), flush=True)
        warm = _fresh(num_samples, seq_length, cache)
        print(json.dumps({"warm": warm}), flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"cold": cold, "warm": warm, "cores": os.cpu_count()}


def markdown(result: dict[str, Any]) -> str:
    cold, warm = result["cold"], result["warm"]
    disk = sum(cold["bytes"].values()) / 2**30
    return (f"| {cold['num_samples']:.2e} | {cold['seq_length']} | {cold['seconds']:.1f} | {cold['cpu_seconds']:.1f} | "
            f"{cold['peak_rss'] / 2**30:.2f} GiB | {warm['seconds']:.2f} | {warm['peak_rss'] / 2**30:.2f} GiB | "
            f"{disk:.2f} GiB | {cold['load_average']:.1f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=float, default=NUM_SAMPLES)
    parser.add_argument("--seq-length", type=int, default=SEQ_LENGTH)
    parser.add_argument("--json", default=None, help="write the measurements here")
    args = parser.parse_args(argv)
    result = run(int(args.samples), args.seq_length)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print("| samples | seq | cold: wall s | CPU s | peak RSS | warm: wall s | peak RSS | on disk | load average |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(markdown(result))


if __name__ == "__main__":
    main()
