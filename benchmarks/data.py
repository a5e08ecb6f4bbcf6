"""Data at pretraining scale: the samples-mapping build and preprocess throughput.

    .venv/bin/python benchmarks/data.py [--quick] [--json out.json]

1. Samples mapping (BERT, ``max_seq_length`` 512, ``short_seq_prob`` 0.1, seed 1234) of 1e6, 1e7
   and 2.56e8 samples (the bert_large recipe: 1,000,000 steps x 256) over a synthetic corpus made
   here: 2.1 M sentences of log-normal length (median 24 tokens) in documents of log-normal length
   (median 20 sentences). The original sentence-by-sentence loop (``tests/samples_reference.py``)
   against the vectorised, cached build (``lightning_megatron/data/samples_index.py``); the loop is
   skipped at 2.56e8 and extrapolated linearly from 1e7. Then a 2-process start at 2.56e8: cold
   (one process builds, the other waits for it) and warm (both memory-map the cached file).
   Every measurement runs in a fresh process; peak RSS is its ``getrusage`` high-water mark.
2. ``preprocess`` throughput (MB of text per second) with 1 and 2 worker processes, on the built-in
   corpus and on a JSON lines file written here.

Indicative only: the machine may be shared; the background load is recorded with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import multiprocessing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

__all__ = ["markdown_section", "run_data", "synthetic_corpus"]

MAX_SEQ_LENGTH = 512
SEED = 1234
SHORT_SEQ_PROB = 0.1
SENTENCES = 2_100_000
SAMPLE_COUNTS = (1_000_000, 10_000_000, 256_000_000)
LOOP_MAX = 10_000_000


def synthetic_corpus(sentences: int = SENTENCES, seed: int = 0):
    """(sizes, doc_idx) of a corpus with realistic lengths: sentences log-normal around 24 tokens
    (clipped to 1..509), documents log-normal around 20 sentences."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(20), 1.0, sentences // 10).astype(np.int64))
    doc_idx = np.r_[0, np.cumsum(lengths)]
    doc_idx = doc_idx[doc_idx <= sentences]
    sizes = np.clip(rng.lognormal(np.log(24), 0.6, int(doc_idx[-1])), 1, MAX_SEQ_LENGTH - 3).astype(np.int32)
    return sizes, doc_idx


def _background() -> float:
    return os.getloadavg()[0]


def _index_job(kind: str, num_samples: int, cache_dir: str | None) -> dict[str, Any]:
    """In a fresh process: build (or map) one samples mapping; time and peak RSS."""
    import numpy as np

    from lightning_megatron.data.samples_index import cached_samples_mapping  # both kinds: the same baseline
    from samples_reference import reference_samples_mapping

    sizes, doc_idx = synthetic_corpus()
    documents = np.arange(len(doc_idx) - 1)
    kwargs = dict(max_num_tokens=MAX_SEQ_LENGTH - 3, seed=SEED, num_samples=num_samples,
                  short_seq_prob=SHORT_SEQ_PROB, min_num_sentences=2)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss_before, cpu_before = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    if kind == "loop":
        mapping = reference_samples_mapping(sizes, doc_idx, documents, **kwargs)
        checksum = int(mapping[-1, 0])
    else:
        mapping = cached_samples_mapping(sizes, doc_idx, documents, cache_dir=cache_dir, name="bench", **kwargs)
        checksum = int(mapping[-1, 0])  # touches the map: the start is complete
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - cpu_before
    peak = usage.ru_maxrss * 1024
    return {"kind": kind, "num_samples": num_samples, "seconds": seconds, "cpu_seconds": cpu, "peak_rss": peak,
            "baseline_rss": rss_before * 1024, "rows": int(len(mapping)), "checksum": checksum,
            "mapping_bytes": int(mapping.nbytes)}


def _in_fresh_processes(jobs: list[tuple]) -> list[dict[str, Any]]:
    """Run the jobs concurrently, each in its own fresh (spawned) process."""
    context = multiprocessing.get_context("spawn")
    pools = [ProcessPoolExecutor(1, mp_context=context) for _ in jobs]  # a pool each: no process takes two jobs
    try:
        futures = [pool.submit(_index_job, *job) for pool, job in zip(pools, jobs)]
        return [f.result() for f in futures]
    finally:
        for pool in pools:
            pool.shutdown()


def run_samples_index(quick: bool, only: tuple[int, ...] | None = None) -> dict[str, Any]:
    import numpy as np

    sizes, doc_idx = synthetic_corpus()
    corpus = {"sentences": int(len(sizes)), "documents": int(len(doc_idx) - 1), "tokens": int(sizes.sum()),
              "mean_sentence": float(sizes.mean()), "mean_document": float(np.diff(doc_idx).mean())}
    counts = only or (SAMPLE_COUNTS[:2] if quick else SAMPLE_COUNTS)
    rows = []
    tmp = tempfile.mkdtemp(prefix="lm-bench-data-")
    try:
        for n in counts:
            row: dict[str, Any] = {"num_samples": n}
            if n <= LOOP_MAX:
                row["loop"] = _in_fresh_processes([("loop", n, None)])[0]
                row["loop"]["background"] = _background()
            cache = os.path.join(tmp, f"n{n}")
            t0 = time.perf_counter()
            if n == counts[-1]:  # a 2-process start: cold (one builds, one waits), then warm
                cold = _in_fresh_processes([("new", n, cache), ("new", n, cache)])
                row["cold_2proc"] = cold
                row["new"] = max(cold, key=lambda r: r["seconds"])
                row["warm_2proc"] = _in_fresh_processes([("new", n, cache), ("new", n, cache)])
            else:
                row["new"] = _in_fresh_processes([("new", n, cache)])[0]
                row["warm"] = _in_fresh_processes([("new", n, cache)])[0]
            row["new"]["background"] = _background()
            row["new"]["wall_with_spawn"] = time.perf_counter() - t0
            rows.append(row)
            shutil.rmtree(cache, ignore_errors=True)
            print(json.dumps({k: v for k, v in row.items()}, default=str)[:400], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    loop_rows = [r for r in rows if "loop" in r]
    if loop_rows and counts[-1] > LOOP_MAX:
        last = loop_rows[-1]["loop"]
        scale = counts[-1] / last["num_samples"]
        growth = (last["peak_rss"] - last["baseline_rss"]) * scale
        rows[-1]["loop_extrapolated"] = {"seconds": last["seconds"] * scale, "cpu_seconds": last["cpu_seconds"] * scale,
                                         "peak_rss": last["baseline_rss"] + growth}
    return {"corpus": corpus, "rows": rows, "max_seq_length": MAX_SEQ_LENGTH, "short_seq_prob": SHORT_SEQ_PROB}


def _preprocess_job(inputs: list[str] | None, workers: int, out: str) -> dict[str, Any]:
    from lightning_megatron.data.preprocess import preprocess_corpus

    stats = preprocess_corpus(inputs, out, None, max_seq_length=MAX_SEQ_LENGTH, workers=workers)
    return {"text_bytes": stats.text_bytes, "seconds": stats.seconds, "documents": stats.written_documents,
            "tokens": stats.tokens, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_preprocess(quick: bool) -> list[dict[str, Any]]:
    from lightning_megatron.data.corpus import default_corpus_documents

    tmp = tempfile.mkdtemp(prefix="lm-bench-pre-")
    rows = []
    try:
        jsonl = os.path.join(tmp, "corpus.jsonl")
        with open(jsonl, "w") as f:
            docs = list(default_corpus_documents())
            for copy in range(2 if quick else 6):
                for i, doc in enumerate(docs):
                    f.write(json.dumps({"id": f"{copy}-{i}", "text": " ".join(doc)}) + "\n")
        context = multiprocessing.get_context("spawn")
        for name, inputs in (("built-in corpus", None), ("JSON lines", [jsonl])):
            for workers in (1, 2):
                with ProcessPoolExecutor(1, mp_context=context) as pool:
                    result = pool.submit(_preprocess_job, inputs, workers, os.path.join(tmp, f"out-{workers}")).result()
                result.update(input=name, workers=workers, background=_background(),
                              mb_per_s=result["text_bytes"] / 1e6 / result["seconds"])
                rows.append(result)
                print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def run_data(quick: bool = False) -> dict[str, Any]:
    return {"samples_index": run_samples_index(quick), "preprocess": run_preprocess(quick)}


def _fmt_samples(n: int) -> str:
    return f"{n:.2e}".replace("e+0", "e")


def markdown_section(data: dict[str, Any]) -> list[str]:
    """The data section of docs/benchmarks.md."""
    L: list[str] = ["## Data at pretraining scale\n"]
    idx = data["samples_index"]
    c = idx["corpus"]
    base = idx["rows"][0]["new"]["baseline_rss"]
    L.append(f"Samples mapping of a synthetic corpus made by `benchmarks/data.py`: {c['sentences']:,} sentences "
             f"(mean {c['mean_sentence']:.1f} tokens), {c['documents']:,} documents (mean "
             f"{c['mean_document']:.1f} sentences), {c['tokens'] / 1e6:.0f} M tokens; max_seq_length "
             f"{idx['max_seq_length']}, short_seq_prob {idx['short_seq_prob']}. Each figure is one fresh process "
             f"(peak RSS = its `getrusage` high-water mark, including the {base / 2**20:.0f} MiB of the "
             f"interpreter, torch and the corpus arrays before the build); *background* is the load "
             f"average meanwhile (the machine has {os.cpu_count()} cores).\n")
    L.append("| samples | original loop: wall s | CPU s | peak RSS | new, cold: wall s | CPU s | peak RSS | "
             "warm start: wall s | peak RSS | background |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cpu(run: dict[str, Any]) -> str:
        return f"{run['cpu_seconds']:.1f}" if "cpu_seconds" in run else "-"

    for r in idx["rows"]:
        loop = r.get("loop") or r.get("loop_extrapolated")
        tag = "" if "loop" in r else " (extrapolated)"
        warm = r.get("warm") or (max(r["warm_2proc"], key=lambda x: x["seconds"]) if "warm_2proc" in r else None)
        L.append(f"| {_fmt_samples(r['num_samples'])} | "
                 + (f"{loop['seconds']:.1f}{tag} | {cpu(loop)}{tag} | {loop['peak_rss'] / 2**30:.2f} GiB{tag} | "
                    if loop else "- | - | - | ")
                 + f"{r['new']['seconds']:.1f} | {cpu(r['new'])} | {r['new']['peak_rss'] / 2**30:.2f} GiB | "
                 + (f"{warm['seconds']:.2f} | {warm['peak_rss'] / 2**30:.2f} GiB | " if warm else "- | - | ")
                 + f"{r['new'].get('background', 0):.1f} |")
    last = idx["rows"][-1]
    if "cold_2proc" in last:
        cold = ", ".join(f"{x['seconds']:.1f} s / {x['peak_rss'] / 2**30:.2f} GiB" for x in last["cold_2proc"])
        warm = ", ".join(f"{x['seconds']:.2f} s / {x['peak_rss'] / 2**30:.2f} GiB" for x in last["warm_2proc"])
        L.append(f"\n2-process start at {_fmt_samples(last['num_samples'])} samples (mapping "
                 f"{last['new']['mapping_bytes'] / 2**30:.2f} GiB on disk, uint32): cold, one process builds while "
                 f"the other waits for the file: {cold}; warm, both memory-map it: {warm}.\n")
    L.append("\n`preprocess` throughput (MB of sentence text per second, one fresh process, its workers included):\n")
    L.append("| input | workers | MB | documents | s | MB/s | background |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in data["preprocess"]:
        L.append(f"| {r['input']} | {r['workers']} | {r['text_bytes'] / 1e6:.1f} | {r['documents']:,} | "
                 f"{r['seconds']:.1f} | {r['mb_per_s']:.2f} | {r['background']:.1f} |")
    L.append("")
    return L


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1e6 and 1e7 samples only, a smaller JSONL file")
    parser.add_argument("--json", default=None, help="write the measurements here")
    parser.add_argument("--samples", default=None,
                        help="comma-separated sample counts instead of the default ones (e.g. 256000000)")
    parser.add_argument("--render-only", default=None, metavar="JSON", help="measure nothing: print the section")
    parser.add_argument("--update", default=None, metavar="JSON",
                        help="replace the rows of --samples in this earlier --json file, keep the rest")
    args = parser.parse_args(argv)
    if args.render_only:
        with open(args.render_only) as f:
            print("\n".join(markdown_section(json.load(f))))
        return
    if args.samples:
        only = tuple(int(float(n)) for n in args.samples.split(","))
        fresh = run_samples_index(args.quick, only)
        if args.update:
            with open(args.update) as f:
                data = json.load(f)
            rows = {r["num_samples"]: r for r in data["samples_index"]["rows"]}
            rows.update({r["num_samples"]: r for r in fresh["rows"]})
            merged = [rows[n] for n in sorted(rows)]
            loop_rows = [r for r in merged if "loop" in r]
            for r in merged:
                if "loop" not in r and loop_rows:  # extrapolate the loop from the largest measured count
                    last = loop_rows[-1]["loop"]
                    scale = r["num_samples"] / last["num_samples"]
                    r["loop_extrapolated"] = {"seconds": last["seconds"] * scale,
                                              "cpu_seconds": last["cpu_seconds"] * scale,
                                              "peak_rss": last["baseline_rss"] + (
                                                  last["peak_rss"] - last["baseline_rss"]) * scale}
            data["samples_index"]["rows"] = merged
        else:
            data = {"samples_index": fresh, "preprocess": run_preprocess(args.quick)}
    else:
        data = run_data(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    print("\n".join(markdown_section(data)))


if __name__ == "__main__":
    main()
