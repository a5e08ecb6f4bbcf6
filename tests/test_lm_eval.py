"""lm-evaluation-harness on an exported decoder, with the tasks that ship in ``evals/tasks`` (nothing downloaded).

One fixture: a tiny Llama-shaped ``GPTLightningModule`` (the packaged 8,192-piece BPE) fine-tuned in this
process on the shipped questions written in the tasks' prompt format (``Question: ...\\nAnswer: ...``, 80
steps: it learns them), saved by the MegatronStrategy, exported by ``export_hf`` (``export hf``) and evaluated
by ``lm_eval.simple_evaluate(model="hf", ...)`` on both shipped tasks, from another directory (the tasks
find their rows wherever lm-eval runs). Our side is the module loaded from the checkpoint, not the export:

- ``lightning_megatron_qa`` (generate_until): lm-eval's greedy answer to every question equals the
  text of ``GPTLightningModule.generate`` on the same prompt ids, cut at the task's stop strings, and its
  exact match equals the one of our answers;
- ``lightning_megatron_qa_mc`` (multiple_choice): every log-likelihood lm-eval reports (144: 36 questions
  x 4 choices) equals the one from our logits within 1e-4, with the same is-greedy flag, and its ``acc`` is
  the accuracy of our argmax;
- the figures are in range, and the fine-tuning shows in them (chance is 0.25 for ``acc``).

A wrong export (weights, rotary, tokenizer) or a task that renders another prompt than the one documented
fails here.
"""

from __future__ import annotations

import json
import math
import os
import random
import string
from pathlib import Path

import lm_eval  # the test extra installs it: a missing lm_eval fails here, never skips
import numpy
import pytest
import torch

from dist_utils import test_device
from megatron_testing import make_trainer
from test_custom_module import hermetic


ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "evals" / "tasks"
GENERATE, CHOICE = "lightning_megatron_qa", "lightning_megatron_qa_mc"
PROMPT = "Question: {question}\nAnswer:"
"""What both shipped tasks render (their ``doc_to_text``); the answer follows after one space."""
STOP, MAX_NEW = ("\n", "."), 16  # the generate task's ``until`` and ``max_gen_toks``
SEQ, STEPS = 40, 80
LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             max_sequence_length=64, hidden_dropout=0.0, attention_dropout=0.0, spec="llama_layer_spec",
             activation="silu", gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True)  # GPTConfig; vocab_size: the tokenizer's


def _rows() -> list[dict]:
    return [json.loads(line) for line in (TASKS / "qa.jsonl").read_text(encoding="utf-8").splitlines() if line]


def _samples(tokenizer) -> list[dict[str, torch.Tensor]]:
    """Every question and its answer as the tasks write them, ended by a newline and EOD; loss on every real
    token, none on the padding."""
    out = []
    for row in _rows():
        ids = tokenizer.tokenize(PROMPT.format(**row) + f" {row['answer']}\n") + [tokenizer.eod]
        assert len(ids) <= SEQ + 1, (row, len(ids))
        pad = SEQ + 1 - len(ids)
        ids = torch.tensor(ids + [tokenizer.eod] * pad)
        mask = torch.tensor([1.0] * (SEQ - pad) + [0.0] * pad)
        out.append({"tokens": ids[:-1], "labels": ids[1:], "loss_mask": mask})
    return out


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> dict:
    from lm_eval.tasks import TaskManager
    from torch.utils.data import DataLoader

    from lightning_megatron.data.bpe_tokenizer import BPETokenizer, packaged_bpe_tokenizer_file
    from lightning_megatron.export import export_hf
    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer = BPETokenizer()
    cwd = os.getcwd()
    with hermetic():
        # A tiny model: a second thread only waits (20x slower on a busy 2-core machine). OMP_NUM_THREADS keeps
        # Lightning's launcher from raising the count again.
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                          OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
        trainer = make_trainer(MegatronStrategy(micro_batch_size=12), 1, STEPS)
        module = GPTLightningModule({**LLAMA, "vocab_size": tokenizer.vocab_size}, lr=1e-2)
        trainer.fit(module, DataLoader(_samples(tokenizer), batch_size=36))
        trainer.save_checkpoint(root / "ckpt")
        export_hf(root / "ckpt", root / "hf", tokenizer=packaged_bpe_tokenizer_file())
        os.chdir(root)  # not the repository: the tasks read their rows from beside their YAML
        rng = random.getstate(), numpy.random.get_state()  # simple_evaluate seeds them (torch's: hermetic)
        try:
            results = lm_eval.simple_evaluate(
                model="hf", model_args={"pretrained": str(root / "hf"), "dtype": "float32"}, tasks=[GENERATE, CHOICE],
                task_manager=TaskManager(include_path=str(TASKS), include_defaults=False), device=test_device(),
                batch_size=1, log_samples=True)
        finally:
            os.chdir(cwd)
            random.setstate(rng[0])
            numpy.random.set_state(rng[1])
    # Our model, independent of the export, on the test device (where conftest creates the tests' tensors)
    ours = GPTLightningModule.load_from_checkpoint(root / "ckpt", map_location=test_device())
    return {"results": results, "module": ours, "tokenizer": tokenizer}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest restores the count after each test


def _normalized(text: str) -> str:
    """exact_match's comparison with ``ignore_case`` and ``ignore_punctuation``, after ``remove_whitespace``."""
    return text.strip().lower().translate(str.maketrans("", "", string.punctuation))


def test_shipped_rows_are_well_formed():
    rows = _rows()
    assert len(rows) >= 30
    assert len({r["question"] for r in rows}) == len(rows)  # no question twice
    for r in rows:
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4, r
        assert r["choices"][r["label"]] == r["answer"], r
    assert {r["label"] for r in rows} == {0, 1, 2, 3}  # the answer is not always in one place


def test_lm_eval_greedy_answers_are_our_generations(evaluated):
    module, tokenizer = evaluated["module"], evaluated["tokenizer"]
    samples = evaluated["results"]["samples"][GENERATE]
    assert len(samples) == len(_rows())
    ours_correct = []
    for s in samples:
        [(context, kwargs)] = s["arguments"]
        assert context == PROMPT.format(**s["doc"])  # the task renders the documented prompt
        assert (tuple(kwargs["until"]), kwargs["max_gen_toks"], kwargs["do_sample"]) == (STOP, MAX_NEW, False)
        ids = torch.tensor([tokenizer.tokenize(context)])
        new = module.generate(ids, MAX_NEW, stop_token=tokenizer.eod)[0, ids.shape[1]:].tolist()
        text = tokenizer.detokenize(new[:new.index(tokenizer.eod)] if tokenizer.eod in new else new)
        for stop in STOP:  # lm-eval cuts the text before its first stop string
            text = text.split(stop)[0]
        assert s["resps"] == [[text]], (context, s["resps"], text)
        ours_correct.append(_normalized(text) == _normalized(s["target"]))
    got = evaluated["results"]["results"][GENERATE]["exact_match,strip"]
    assert got == pytest.approx(sum(ours_correct) / len(ours_correct), abs=1e-12)


def _loglikelihood(module, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) from our logits and whether it is the greedy continuation, with the
    token split lm-eval's HF model uses: the ids of ``context + continuation``, those past ``context``'s ids
    being the continuation's."""
    whole, head = tokenizer.tokenize(context + continuation), tokenizer.tokenize(context)
    target = torch.tensor(whole[len(head):])
    with torch.no_grad():
        logits = module.model_chunks[0](torch.tensor([whole[:-1]]))[0, len(head) - 1:, :tokenizer.vocab_size]
    logp = torch.log_softmax(logits.double(), dim=-1)
    return float(logp.gather(-1, target[:, None]).sum()), bool(torch.equal(logp.argmax(-1), target))


def test_lm_eval_loglikelihoods_are_our_logits(evaluated):
    module, tokenizer = evaluated["module"], evaluated["tokenizer"]
    module.eval()
    samples = evaluated["results"]["samples"][CHOICE]
    assert len(samples) == len(_rows())
    ours, theirs, ours_correct = [], [], []
    for s in samples:
        doc = s["doc"]
        assert s["arguments"] == [(PROMPT.format(**doc), f" {c}") for c in doc["choices"]]
        mine = [_loglikelihood(module, tokenizer, *a) for a in s["arguments"]]
        ours += mine
        theirs += [r[0] for r in s["resps"]]
        ours_correct.append(max(range(4), key=lambda i: mine[i][0]) == doc["label"])
    worst = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs))
    assert len(ours) == 4 * len(_rows()) and worst <= 1e-4, f"max |log-likelihood lm-eval - ours| = {worst:.2e}"
    assert [a[1] for a in ours] == [b[1] for b in theirs]  # is-greedy
    got = evaluated["results"]["results"][CHOICE]["acc,none"]
    assert got == pytest.approx(sum(ours_correct) / len(ours_correct), abs=1e-12)


def test_metrics_are_in_range_and_show_the_fine_tuning(evaluated):
    results = evaluated["results"]["results"]
    figures = {GENERATE: ("exact_match,strip",), CHOICE: ("acc,none", "acc_norm,none")}
    for task, metrics in figures.items():
        assert results[task]["sample_len"] == len(_rows())
        for metric in metrics:
            value, stderr = results[task][metric], results[task][metric.replace(",", "_stderr,")]
            assert 0.0 <= value <= 1.0 and math.isfinite(stderr) and stderr >= 0.0, (task, metric, value, stderr)
    # Trained on these very questions: the answers are learnt (multiple-choice chance: 0.25)
    assert results[CHOICE]["acc,none"] >= 0.9 and results[GENERATE]["exact_match,strip"] >= 0.9, results
