"""``lightning-megatron predict`` for decoders: a prompts file in, ``predictions/predictions.jsonl`` out.

Through the real CLI (subprocesses): a tiny ``recipes/gpt_tiny.yaml`` fit at TP=2 on 2 processes writes
``last.ckpt``; ``predict`` at TP=2 on 2 processes generates greedy continuations of a prompts file of
mixed lengths; every prompt is written once, in input order, with the token ids
``GPTLightningModule.load_from_checkpoint(...).generate(...)`` gives in one process (the reference).
The same runs show what a decoder run prints and leaves (issue 34): ``loss`` once per progress line (not
``lm_loss`` too), no warning that asks nothing of the user, no W&B run or training-CSV version added by
``predict``, a ``plot`` of the run, and the export's ``config.json`` carrying the dropouts it trained with.
In-process: the prompts' batches (grouped by length, full global batches, padding -1) at DP=2.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from dist_utils import run_python

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The function returns", "A list of", "The module", "If the value is None, the",
           "Return a new"]
MAX_NEW = 6
# A tiny gpt_tiny: both commands build the same model from the same overrides.
# The recipe's loggers (CSV, W&B offline), progress bar, dropouts (0.1) and sequence length (128: the built-in
# corpus's test split holds no sample of it, which predict does not need).
SMALL = ["--config", str(ROOT / "recipes" / "gpt_tiny.yaml"), "--trainer.devices", "2",
         "--trainer.strategy.tensor_model_parallel_size", "2", "--model.config.num_layers", "1",
         "--model.config.hidden_size", "32", "--model.config.num_attention_heads", "2",
         "--model.config.ffn_hidden_size", "64"]
NOISE = ("anonymous setting", "💡 Tip", "LeafSpec", "LengthGroupedBatchSampler", "no test dataset", "args parameter")
"""What printed on every decoder run, asking nothing of the user (issue 34)."""


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    proc = run_python(["-m", "lightning_megatron.cli", *args], tmp_path, dict(os.environ, WANDB_MODE="offline"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def test_cli_predict_generates_what_generate_gives(tmp_path):
    from lightning_megatron.data.bpe_tokenizer import BPETokenizer
    from lightning_megatron.generation import row_seed
    from lightning_megatron.models.gpt.module import GPTLightningModule

    tokenizer = BPETokenizer()  # GPTDataModule's default
    lengths = [len(tokenizer.tokenize(p)) for p in PROMPTS]
    # Mixed lengths, two of them shared: batches of one length, one of them padded.
    assert len(set(lengths)) >= 3 and len(set(lengths)) < len(lengths), lengths
    run = tmp_path / "run"
    fit = _cli(tmp_path, "fit", *SMALL, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
               "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1",
               "--trainer.default_root_dir", str(run), "--data.global_batch_size", "4", "--data.micro_batch_size", "2",
               "--data.eval_samples", "4")
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (run / "checkpoints").iterdir())
    # Output redirected: plain lines (not a bar drawn only at the end); the loss once, not lm_loss beside it
    lines = [line for line in fit.stdout.splitlines() if line.startswith(("Step ", "Validation at step"))]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2", "at"], fit.stdout[-3000:]
    assert all(" loss " in line and "lm_loss" not in line and "mfu" in line for line in lines[:2]), lines
    assert lines[2].startswith("Validation at step 2: val_loss ") and "val_perplexity" in lines[2], lines
    assert not [n for n in NOISE if n in fit.stderr], fit.stderr[-3000:]
    # blank lines are skipped: each record names its line of the file (index: the prompt's place among the texts)
    (tmp_path / "prompts.txt").write_text("\n".join([*PROMPTS[:2], "", "   ", *PROMPTS[2:4], "", PROMPTS[4]]) + "\n")
    # One global batch of 2 (two microbatches of 1) per length group.
    predicted = _cli(tmp_path, "predict", *SMALL, "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(run),
                     "--data.predict_file", str(tmp_path / "prompts.txt"), "--data.global_batch_size", "2",
                     "--data.micro_batch_size", "1", "--model.predict_max_new_tokens", str(MAX_NEW))
    assert not [n for n in NOISE if n in predicted.stderr], predicted.stderr[-3000:]
    # it says where its output went (fit prints its run summary)
    assert f"lightning-megatron: predictions: {run / 'predictions' / 'predictions.jsonl'}\n" in predicted.stdout
    # predict added no W&B segment to the training run, no csv/version_N among its versions
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1
    assert sorted(p.relative_to(run / "csv").parent.as_posix() for p in (run / "csv").rglob("hparams.yaml")) == [
        "predict/version_0", "version_0"]
    records = [json.loads(line) for line in (run / "predictions" / "predictions.jsonl").open()]
    assert [r["index"] for r in records] == list(range(len(PROMPTS)))  # every prompt once, in order
    assert [r["line"] for r in records] == [1, 2, 5, 6, 8]  # before: none, and index alone misled past a blank line
    assert [r["prompt"] for r in records] == PROMPTS
    module = GPTLightningModule.load_from_checkpoint(ckpt)  # the reference: one process
    for record, prompt in zip(records, PROMPTS):
        ids = torch.tensor([tokenizer.tokenize(prompt)])
        want = module.generate(ids, MAX_NEW, stop_token=tokenizer.eod)[0, ids.shape[1]:].tolist()
        text = want
        if tokenizer.eod in want:  # predict_stop_at_eod (the default): the ids end with EOD, the text before it
            want, text = want[:want.index(tokenizer.eod) + 1], want[:want.index(tokenizer.eod)]
        assert record["token_ids"] == want, (prompt, record, want)
        assert record["completion"] == tokenizer.detokenize(text)
    # at CP=2 (every CP rank generates the whole prompts), one writer (both CP ranks wrote and removed the same
    # temporary file: FileNotFoundError on one rank, the other's connection closed); sampled with --model.predict_seed
    # (the draws came from the generator the checkpoint restores: no seed changed them, each layout drew others):
    # each prompt's tokens those one process samples with the prompt's seed
    into_cp = _cli(tmp_path, "predict", *SMALL, "--ckpt_path", str(ckpt), "--trainer.default_root_dir",
                   str(tmp_path / "cp"), "--trainer.strategy.tensor_model_parallel_size", "1",
                   "--trainer.strategy.context_parallel_size", "2", "--data.predict_file",
                   str(tmp_path / "prompts.txt"), "--data.global_batch_size", "2", "--data.micro_batch_size", "1",
                   "--model.predict_max_new_tokens", str(MAX_NEW), "--model.predict_greedy", "false",
                   "--model.predict_top_k", "20", "--model.predict_seed", "3")
    # into another run folder: Lightning's "The dirpath has changed" (the checkpoint's best-k bookkeeping) said nothing
    assert not [n for n in (*NOISE, "dirpath has changed") if n in into_cp.stderr], into_cp.stderr[-3000:]
    sampled = [json.loads(line) for line in (tmp_path / "cp" / "predictions" / "predictions.jsonl").open()]
    assert [r["index"] for r in sampled] == list(range(len(PROMPTS)))
    for record, prompt in zip(sampled, PROMPTS):
        ids = torch.tensor([tokenizer.tokenize(prompt)])
        want = module.generate(ids, MAX_NEW, stop_token=tokenizer.eod, greedy=False, top_k=20,
                               seeds=[row_seed(3, record["index"])])[0, ids.shape[1]:].tolist()
        if tokenizer.eod in want:
            want = want[:want.index(tokenizer.eod) + 1]
        assert record["token_ids"] == want, (prompt, record, want)
    assert [r["token_ids"] for r in sampled] != [r["token_ids"] for r in records]  # sampled, not greedy
    _plot_and_export_the_run(tmp_path, run, module)


def _plot_and_export_the_run(tmp_path: Path, run: Path, module) -> None:
    """``plot`` of the run: the next-token loss and the perplexity, no second panel for lm_loss (equal to the
    loss). ``export hf``: config.json carries the dropouts the model trained with (the recipe's 0.1), and
    transformers' GPT-2 in eval mode computes the module's logits."""
    import transformers

    from lightning_megatron.cli import main
    from lightning_megatron.plot import columns, read_run

    [(title, panels)] = columns([read_run(run)])
    assert (title, [label for _, label, _ in panels]) == ("next-token LM (decoder)", ["next-token loss", "perplexity"])
    main(["plot", str(run), "--output", str(tmp_path / "curves.png")])
    assert (tmp_path / "curves.png").is_file()
    main(["export", "hf", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--output", str(tmp_path / "hf")])
    mask = os.umask(0o022)
    os.umask(mask)  # the folder and its files readable as the umask says (mkdtemp's 0700 was left: others could not)
    assert {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "hf", *(tmp_path / "hf").iterdir()]} == {
        p.name: (0o777 if p.is_dir() else 0o666) & ~mask for p in [tmp_path / "hf", *(tmp_path / "hf").iterdir()]}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert module.config.hidden_dropout == module.config.attention_dropout == 0.1
    assert (config["resid_pdrop"], config["embd_pdrop"], config["attn_pdrop"]) == (0.1, 0.1, 0.1), config
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    module.eval()
    with torch.no_grad():
        ours = module.model_chunks[0](tokens)[..., :hf.config.vocab_size]
        theirs = hf(input_ids=tokens).logits
    err = float((ours - theirs).abs().max())
    assert err <= 1e-5, f"max |ours - transformers| = {err:.2e}"


def test_predict_stops_at_eod_and_the_writer_cuts_there():
    from types import SimpleNamespace

    from lightning_megatron.callbacks.prediction_writer import PredictionWriter
    from lightning_megatron.data.bpe_tokenizer import BPETokenizer
    from lightning_megatron.generation import StopRule
    from lightning_megatron.models.gpt import GPTConfig
    from lightning_megatron.models.gpt.module import GPTLightningModule

    tokenizer = BPETokenizer()
    eod = tokenizer.eod
    writer = PredictionWriter()
    writer._tokenizer, writer._texts = tokenizer, None
    writer._stop = StopRule(stop_token=eod, detokenize=tokenizer.detokenize)  # the module's predict_stop_rule
    prompt = tokenizer.tokenize("The function")
    a, b = tokenizer.tokenize(" returns a value")[:3], tokenizer.tokenize(" is")[:1]
    # row 0 ended after b (then padded with EOD, as generate pads ended rows); row 1 did not end
    tokens = torch.tensor([prompt, prompt])
    generated = torch.tensor([prompt + b + [eod, eod, eod], prompt + a + [b[0]]])
    writer._collect_generated(tokens, generated, torch.tensor([0, 1]), torch.tensor([True, True]))
    (_, ended), (_, running) = writer._records
    assert ended["token_ids"] == b + [eod] and ended["completion"] == tokenizer.detokenize(b)
    assert running["token_ids"] == a + b and running["completion"] == tokenizer.detokenize(a + b)
    # A stop string ends row 0 at the token that completes it: the ids end there, the text before the string.
    text = tokenizer.detokenize(b)
    writer._stop = StopRule(stop_token=eod, stop_strings=[text[1:]], detokenize=tokenizer.detokenize)
    writer._records = []
    writer._collect_generated(tokens, generated, torch.tensor([0, 1]), torch.tensor([True, False]))
    [(_, cut)] = writer._records
    assert cut["token_ids"] == b and cut["completion"] == text[:1]
    # Without a datamodule tokenizer to take EOD from, predict_stop_at_eod=True is refused, not ignored; so are
    # stop strings without a tokenizer to read the text with. Any datamodule with a tokenizer will do.
    tiny = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64)
    module = GPTLightningModule(tiny)
    module.trainer = SimpleNamespace(datamodule=None)  # a predict over a plain dataloader
    with pytest.raises(ValueError, match=r"predict_stop_at_eod=True.*set predict_stop_at_eod=False"):
        module.predict_stop_rule()
    assert GPTLightningModule(tiny, predict_stop_at_eod=False).predict_stop_rule() == StopRule()
    module = GPTLightningModule(tiny, predict_stop_at_eod=False, predict_stop_strings=["\n"])
    module.trainer = SimpleNamespace(datamodule=None)
    with pytest.raises(ValueError, match=r"predict_stop_strings=\['\\n'\].*drop predict_stop_strings"):
        module.predict_stop_rule()
    module.trainer = SimpleNamespace(datamodule=SimpleNamespace(tokenizer=tokenizer))  # e.g. a fine-tuning one
    rule = module.predict_stop_rule()
    assert (rule.stop_token, rule.stop_strings, rule.detokenize) == (None, ("\n",), tokenizer.detokenize)
    assert GPTLightningModule(tiny).stop_rule(tokenizer=tokenizer).stop_token == eod


def test_prompt_batches_at_dp2_hold_one_length_and_every_prompt_once(tmp_path):
    """GPTDataModule's predict batches of a JSONL prompts file at DP=2 (2 microbatches of 1 per rank):
    each global batch holds prompts of one length (rank 0's and rank 1's slices alike), every prompt
    is in exactly one of them, and padding rows (-1) copy a prompt of that length; over-long and
    missing prompts are refused by name."""
    import pytest

    from lightning_megatron.datamodules.gpt import GPTDataModule
    from lightning_megatron.data.predict import SAMPLE_INDEX, IndexedSamples, LengthGroupedBatchSampler

    lines = [json.dumps({"body": p, "id": i}) for i, p in enumerate(PROMPTS)]
    (tmp_path / "p.jsonl").write_text("\n".join([lines[0], "", *lines[1:]]) + "\n")  # a blank line 2
    dm = GPTDataModule(seq_length=16, global_batch_size=4, micro_batch_size=1, num_workers=0,
                       predict_file=str(tmp_path / "p.jsonl"), predict_json_key="body")
    list(dm.predict_dataloader())  # no trainer: DP=1
    prompts = dm.predict_dataset
    assert prompts.texts == PROMPTS and prompts.lines == [1, 3, 4, 5, 6]
    assert [prompts[i]["tokens"].tolist() for i in range(len(PROMPTS))] == [dm.tokenizer.tokenize(p) for p in PROMPTS]
    samples = IndexedSamples(prompts)
    per_rank = [list(LengthGroupedBatchSampler(prompts.lengths, local_batch_size=2, data_parallel_rank=r,
                                               data_parallel_size=2)) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == len(set(prompts.lengths))  # 5 prompts, 3 lengths: 3 batches
    seen = []
    for local0, local1 in zip(*per_rank):
        rows = [samples[i] for i in local0 + local1]
        assert len({len(r["tokens"]) for r in rows}) == 1  # one length per global batch
        seen += [int(r[SAMPLE_INDEX]) for r in rows]
        for i, r in zip(local0 + local1, rows):
            assert (i < 0) == (int(r[SAMPLE_INDEX]) == -1)
    assert sorted(i for i in seen if i >= 0) == list(range(len(PROMPTS)))
    with pytest.raises(ValueError, match="line 5: the prompt has 7 tokens, more than 5"):  # its line, not "prompt 4"
        list(GPTDataModule(seq_length=5, global_batch_size=2, micro_batch_size=1, num_workers=0,
                           predict_file=str(tmp_path / "p.jsonl"), predict_json_key="body").predict_dataloader())
    with pytest.raises(ValueError, match="predict_file"):
        GPTDataModule(seq_length=16, num_workers=0).predict_dataloader()
