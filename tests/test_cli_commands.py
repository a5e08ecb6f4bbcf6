"""The small commands of ``lightning-megatron`` through its entry point (``lightning_megatron.cli.main``,
what the console script calls): train-tokenizer, plot, and the checks of the data before launch."""

from __future__ import annotations

import json
import sys

import pytest

from lightning_megatron.cli import main


def _jsonl(path, key: str, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return str(path)


TEXTS = [f"Document number {i} talks about tokenizers. It has a second sentence about {w}."
         for i, w in enumerate(["apples", "pears", "plums", "cherries", "grapes", "lemons"] * 5)]


def test_train_tokenizer_json_key_and_empty_input(tmp_path, capsys):
    body = _jsonl(tmp_path / "body.jsonl", "body", TEXTS)
    main(["train-tokenizer", "--input", body, "--json-key", "body", "--vocab-size", "200",
          "--output-dir", str(tmp_path / "tok")])
    vocab = (tmp_path / "tok" / "vocab.txt").read_text().split("\n")
    assert {"tokenizers", "apples", "[MASK]"} <= set(vocab) and len(vocab) > 50, vocab[:20]
    # Text under another key than --json-key: no text at all, refused, nothing written
    with pytest.raises(SystemExit) as e:
        main(["train-tokenizer", "--input", body, "--vocab-size", "200", "--output-dir", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no text to train a vocabulary on" in err and "json_key='text'" in err, err
    assert "--json-key" in err and not (tmp_path / "empty" / "vocab.txt").exists()
    # --cased: a cased WordPiece vocabulary (Megatron's BertWordPieceCase), which the tokenizer then keeps cased
    from lightning_megatron.data.tokenizer import BertTokenizer

    main(["train-tokenizer", "--input", body, "--json-key", "body", "--vocab-size", "200", "--cased",
          "--output-dir", str(tmp_path / "cased")])
    vocab = tmp_path / "cased" / "vocab.txt"
    assert "Document" in vocab.read_text().split("\n") and BertTokenizer(vocab).lowercase is False
    with pytest.raises(SystemExit) as e:  # a byte-level BPE never lowercases: the flag is WordPiece's
        main(["train-tokenizer", "--type", "bpe", "--input", body, "--cased", "--output-dir", str(tmp_path / "b")])
    assert e.value.code == 2 and "--cased is WordPiece's" in capsys.readouterr().err


def test_bpe_docs_commands_train_tokenizer_then_preprocess_with_eod(tmp_path, capsys, monkeypatch):
    """The commands of docs/data.md's "BPE tokenizer" section, run in order: train-tokenizer --type bpe on
    JSON lines, then preprocess --tokenizer FOLDER --append-eod with 2 workers: one item per line ending
    in EOD, the sidecar naming the BPE vocabulary. Refused: input without text under --json-key,
    --vocab-file with --tokenizer, --append-eod on WordPiece."""
    import re
    import shlex
    from pathlib import Path

    from lightning_megatron.data import BPETokenizer, IndexedDataset, read_dataset_vocab

    page = (Path(__file__).resolve().parents[1] / "docs" / "data.md").read_text()
    section = page[page.index("## BPE tokenizer"):]
    commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ").splitlines()
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "docs.jsonl", "text", TEXTS)
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "lightning-megatron", command
        main(argv[1:])
    out = capsys.readouterr().out
    assert [c.split()[1] for c in commands] == ["train-tokenizer", "preprocess"], commands
    assert [p.name for p in (tmp_path / "tok").iterdir()] == ["tokenizer.json"]  # no temporary file left
    tok = BPETokenizer(tmp_path / "tok")
    assert tok.eod == 0 and 256 < tok.vocab_size < 8192 and "Ġtokenizers" in tok.inv_vocab, tok.inv_vocab[-20:]
    ds = IndexedDataset(tmp_path / "data" / "gpt")
    assert ds.num_documents == len(ds) == len(TEXTS) and f"written_documents: {len(TEXTS)}" in out, out
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize(t) + [tok.eod] for t in TEXTS]
    record = read_dataset_vocab(tmp_path / "data" / "gpt")
    assert (record.tokenizer_type, record.eod, record.append_eod, record.vocab_size) == ("bpe", 0, True, tok.vocab_size)
    assert record.vocab_file == str((tmp_path / "tok" / "tokenizer.json").resolve())

    body = _jsonl(tmp_path / "body.jsonl", "body", TEXTS)  # the text under another key than --json-key
    with pytest.raises(SystemExit) as e:
        main(["train-tokenizer", "--type", "bpe", "--input", body, "--output-dir", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no text to train a BPE tokenizer on" in err and "--json-key" in err, err
    assert not (tmp_path / "empty" / "tokenizer.json").exists()
    for extra in (["--tokenizer", "tok", "--vocab-file", "v.txt"], ["--append-eod"]):
        with pytest.raises(SystemExit) as e:
            main(["preprocess", "--input", "docs.jsonl", "--output-prefix", "x", *extra])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "pass one of them" in err and "append_eod=True needs a BPE tokenizer" in err, err


def test_fit_refuses_missing_or_foreign_data_before_launch(tmp_path, monkeypatch):
    """A data_prefix without its .bin/.idx, one given with its extension, or a dataset tokenized with
    another vocabulary than data.vocab_file: `fit` exits before building the Trainer, listing each."""
    from pathlib import Path

    from lightning_megatron.data.preprocess import preprocess_corpus
    from lightning_megatron.data.tokenizer import BertTokenizer, train_wordpiece_tokenizer

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])  # as the console script, with argv passed in
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(TEXTS))
    own_vocab = train_wordpiece_tokenizer([text], 200, tmp_path / "tok")
    preprocess_corpus([text], tmp_path / "own", BertTokenizer(own_vocab), max_seq_length=64, progress=False)
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml")
    blend = f"[0.4, {tmp_path / 'nope'}, 0.3, {tmp_path / 'own.bin'}, 0.3, {tmp_path / 'own'}]"
    with pytest.raises(SystemExit) as e:  # the packaged vocabulary (vocab_file null) is not the dataset's
        main(["fit", "--config", recipe, "--trainer.devices", "1", "--trainer.strategy.tensor_model_parallel_size",
              "1", "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / "run"),
              "--data.data_prefix", blend])
    message = str(e.value.code)
    assert "found before launching any process" in message, message
    assert f"{tmp_path / 'nope'}.bin" in message and "lightning-megatron preprocess" in message, message
    assert f"the prefix is the path without .bin: data_prefix={str(tmp_path / 'own')!r}" in message, message
    assert "was tokenized with another vocabulary" in message and "vocab_size=30522" in message, message


def _tiny_bert_fit(tmp_path, *flags: str) -> str:
    """``fit`` of bert_tiny shrunk to one small layer, one process, with ``flags``: its output (exit 0)."""
    import os
    from pathlib import Path

    from dist_utils import run_python

    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml")
    cmd = [sys.executable, "-m", "lightning_megatron.cli", "fit", "--config", recipe, *flags,
           "--trainer.devices", "1", "--trainer.strategy.tensor_model_parallel_size", "1",
           "--trainer.strategy.cpu_tuning", "false", "--trainer.default_root_dir", str(tmp_path / "run"),
           "--model.config.num_layers", "1", "--model.config.hidden_size", "32", "--model.config.num_attention_heads", "2",
           "--model.config.ffn_hidden_size", "64", "--data.global_batch_size", "2", "--data.micro_batch_size", "2",
           "--data.max_seq_length", "32", "--model.config.max_sequence_length", "32"]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    proc = run_python(cmd[1:], tmp_path, env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def test_fit_fast_dev_run(tmp_path):
    """`fit --trainer.fast_dev_run true` with the recipe's 30 warm-up steps and lr_decay_steps null:
    one training step and one validation batch run (Lightning's meaning), nothing is saved."""
    out = _tiny_bert_fit(tmp_path, "--trainer.fast_dev_run", "true")
    assert "lr_decay_steps=null taken as lr_warmup_steps + 1 = 31" in out, out[-3000:]
    assert "fast_dev_run: every step, validation and test ran once on 1 batch(es); nothing was logged or saved" in out
    # warning noise the package caused itself: a model data hook next to a datamodule
    assert "on_before_batch_transfer" not in out, out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_fit_without_checkpointing_saves_nothing(tmp_path):
    """``--trainer.enable_checkpointing false`` (Lightning's flag) over the recipe's ModelCheckpoint was
    Lightning's MisconfigurationException, 13 frames: the run trains and saves no checkpoint, which it says. And
    Lightning's ``Timer`` callback on the command line (its enum default broke the config's YAML dump) runs, and a
    run by epochs (``max_steps -1``) with the recipe's constant weight decay (its horizon was required: a traceback
    on the ranks, ``wd_incr_steps=None means Trainer.max_steps``)."""
    out = _tiny_bert_fit(tmp_path, "--trainer.enable_checkpointing", "false", "--trainer.max_steps", "-1",
                         "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
                         "--lr_schedule.lr_decay_steps", "2",
                         "--trainer.limit_val_batches", "0", "--lr_schedule.lr_warmup_steps", "0",
                         "--trainer.callbacks+=lightning.pytorch.callbacks.Timer", "--trainer.callbacks.duration",
                         "00:01:00:00")
    assert "enable_checkpointing=False: the configured ModelCheckpoint left out; no checkpoint is saved" in out, out
    assert "max_epochs=1` reached" in out, out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_plot_joins_resumes_names_runs_and_draws_validation(tmp_path, capsys):
    """Two runs whose folders share a name; the first resumed (version_1 repeats steps 6-9 after its
    step-5 checkpoint), with one validation point: one joined line per run, told apart in the legend."""
    from lightning_megatron.plot import _labels, read_run

    def write(folder, version, steps, scale, val_steps=()):
        d = folder / "csv" / f"version_{version}"
        d.mkdir(parents=True)
        rows = ["epoch,step,loss,train_lm_loss,val_lm_loss"]
        rows += [f"0,{s},{scale * (12 - s * 0.3)},{scale * (10 - s * 0.3)}," for s in steps]
        rows += [f"0,{s},,,{scale * (9.5 - s * 0.3)}" for s in val_steps]
        (d / "metrics.csv").write_text("\n".join(rows) + "\n")

    a, b = tmp_path / "x" / "run", tmp_path / "y" / "run"
    write(a, 0, range(0, 10), 1.0, val_steps=[4])
    write(a, 1, range(6, 15), 1.01)  # the resume from step 5 repeats 6..9: its values win
    write(b, 0, range(0, 12), 0.9)
    joined = read_run(a)
    assert [s for s, _ in joined["train_lm_loss"]] == list(range(15))
    assert dict(joined["train_lm_loss"])[7] == 1.01 * (10 - 7 * 0.3) and dict(joined["train_lm_loss"])[5] == 10 - 1.5
    assert joined["val_lm_loss"] == [(4, 9.5 - 1.2)]  # (a validation at step >= 6 would be replaced too)
    assert _labels([a, b]) == ["x/run", "y/run"]
    main(["plot", str(a), str(b), "--output", str(tmp_path / "curves.png")])
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path / "empty"), "--output", str(tmp_path / "none.png")])
    assert "no metrics.csv" in capsys.readouterr().err
    # a run's metrics.csv itself is a run; the output's format is its suffix (out.txt got a PNG), one that
    # matplotlib does not write is refused; a missing folder is said so (it said "no metrics.csv under"); a run
    # that logged nothing is named (it was left out of the figure, unsaid)
    main(["plot", str(a / "csv" / "version_0" / "metrics.csv"), "--output", str(tmp_path / "curves.svg")])
    assert (tmp_path / "curves.svg").read_text().lstrip().startswith("<?xml")
    silent = tmp_path / "silent" / "csv" / "version_0"
    silent.mkdir(parents=True)
    (silent / "metrics.csv").write_text("epoch,step,loss\n")
    for argv, said in (([str(a), "--output", str(tmp_path / "out.txt")],
                        "--output '" + str(tmp_path / "out.txt") + "': the suffix names the format, and matplotlib "
                        "writes no '.txt'; use e.g. curves.png, curves.pdf or curves.svg"),
                       ([str(tmp_path / "nope"), "--output", str(tmp_path / "none.png")],
                        "run folder '" + str(tmp_path / "nope") + "' does not exist"),
                       ([str(a), str(tmp_path / "silent"), "--output", str(tmp_path / "none.png")],
                        "run '" + str(tmp_path / "silent") + "' logged no values (its metrics.csv files hold no row "
                        "with a step)")):
        with pytest.raises(SystemExit) as exited:
            main(["plot", *argv])
        assert exited.value.code == 2 and said in capsys.readouterr().err, argv
    assert not (tmp_path / "out.txt").exists() and not (tmp_path / "none.png").exists()


def test_run_summary_prints_every_metric_and_the_throughput(tmp_path):
    """The end-of-run summary lists whatever the run logged (a fine-tuning run's metrics too) and the
    median tokens/s and MFU (the first step, which includes warm-up, left out)."""
    from types import SimpleNamespace

    from lightning_megatron.callbacks.summary import run_summary

    (tmp_path / "metrics.csv").write_text(
        "epoch,step,loss,val_accuracy,val_matthews_corrcoef,tokens_per_sec,mfu\n"
        "0,0,0.70,,,10.0,0.01\n0,1,0.60,,,200.0,0.20\n0,2,0.50,,,220.0,0.22\n0,3,0.40,,,210.0,0.21\n"
        "0,3,,0.75,0.41,,\n")

    class CSVLogger(SimpleNamespace):
        pass

    trainer = SimpleNamespace(fast_dev_run=False, loggers=[CSVLogger(log_dir=str(tmp_path))], checkpoint_callbacks=[])
    text = run_summary(trainer)
    assert "val_accuracy" in text and "0.7500" in text and "val_matthews_corrcoef" in text, text
    assert "loss                     step     0:     0.7000   ->   step     3:     0.4000" in text, text
    assert "tokens_per_sec           median over steps 0-3: 210" in text and "mfu" in text and "0.21" in text, text


def test_peak_measurement_leaves_the_global_rng_alone():
    """The MFU peak is measured once at fit start with as many GEMM sizes as the machine's speed asks
    for: its operands must not come from the global generator, or dropout masks (and losses) would
    depend on how busy the machine was."""
    import torch

    from lightning_megatron.callbacks.throughput import measure_matmul_tflops

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    for min_seconds in (0.0, 1e-3):  # one size, and likely a few
        assert measure_matmul_tflops(torch.float32, torch.device("cpu"), min_seconds=min_seconds, max_n=512) > 0
    assert torch.equal(torch.get_rng_state(), before)


def test_the_peak_measurement_aims_its_next_size_at_the_time_it_needs_not_double():
    """A 1024 matmul at 13 ms of the 20 wanted is followed by 1280 (~25 ms), not 2048 (~105 ms, five times):
    on one CPU core the doubling cost 0.6 s of a 2-process run's 5 s start. Far too fast: at most double
    (small sizes run below the peak, the cubic law aims short); always one multiple more; never past max_n."""
    from lightning_megatron.callbacks.throughput import next_matmul_size

    assert next_matmul_size(1024, 0.013, 0.02, 8192) == 1280
    assert next_matmul_size(256, 1e-5, 0.02, 8192) == 512
    assert next_matmul_size(1024, 0.0199, 0.02, 8192) == 1280
    assert next_matmul_size(4096, 1e-4, 0.02, 6144) == 6144


_EXIT_PROBE = """
import atexit, gc, sys
gc.disable()  # garbage stays garbage until a collection the command runs
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))  # runs after the command's
class Holder:
    def __del__(self):
        with open(sys.argv[1], "w") as out:
            out.write("finalized")
holder = Holder()
holder.cycle = holder  # garbage in a reference cycle: only a collection finalizes it
del holder
from lightning_megatron.cli import main
main(["--help"])
"""


def test_the_command_exits_collecting_its_garbage_before_freezing_the_rest(tmp_path):
    """The command's last ``atexit`` handler collects the garbage (its finalizers run, as at any exit) before it
    freezes what is alive, which CPython's collections at interpreter teardown then skip
    (cli._collect_then_freeze). A new interpreter: the exit is the subject."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _EXIT_PROBE, str(tmp_path / "del.txt")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.endswith("frozen at exit: True\n"), proc.stdout[-500:]
    assert (tmp_path / "del.txt").read_text() == "finalized"


def test_plot_of_a_few_steps_ticks_whole_steps(tmp_path, monkeypatch):
    """A run of 3 steps was drawn with ticks at steps 0.25, 0.5, ...: the step axis ticks whole steps."""
    import matplotlib.pyplot as plt

    from lightning_megatron.plot import plot_runs

    d = tmp_path / "run" / "csv" / "version_0"
    d.mkdir(parents=True)
    (d / "metrics.csv").write_text("epoch,step,loss\n0,0,3.0\n0,1,2.5\n0,2,2.2\n")
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    plot_runs([tmp_path / "run"], tmp_path / "curves.png")
    ticks = [t for ax in figures[0].axes if ax.get_visible() for t in ax.get_xticks() if 0 <= t <= 2]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
