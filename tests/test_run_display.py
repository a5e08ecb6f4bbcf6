"""What a run shows, in one process (issue 34, "What a run shows"; the CLI runs that show the same through
``lightning-megatron`` are in test_cli_run_folder.py, test_gpt_predict.py and test_finetune_data.py):

- the progress bar's short metrics (``loss`` once, ``tok/s``, ``mfu`` as a percentage, an impossible MFU
  marked) and the ThroughputCallback's warning and the run summary's flag for an MFU above 1;
- the W&B logger offline: an evaluation joining the training run's history at the checkpoint's step, no
  ``anonymous`` setting passed to ``wandb.init``;
- ``plot``: runs grouped by what they measured, labels, no repeated panel, perplexity, evaluation logs left out;
- the decoder data: "no test dataset" said when a test asks for it, not on every ``predict``/``check``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


def test_progress_metrics_are_short_and_an_mfu_above_one_is_flagged(tmp_path):
    from lightning_megatron.callbacks.progress import format_metrics
    from lightning_megatron.callbacks.summary import run_summary
    from lightning_megatron.callbacks.throughput import ThroughputCallback

    loss = torch.tensor(8.9921)
    gpt = {"v_num": "kcpu", "loss": loss, "train_lm_loss": loss.clone(), "val_loss": 8.955, "val_lm_loss": 8.955,
           "tokens_per_sec": 1663.2, "mfu": 0.0391}
    assert format_metrics(gpt) == {"loss": pytest.approx(8.9921), "val_loss": 8.955, "tok/s": "1.66k", "mfu": "3.9%"}
    bert = {"loss": 7.164, "train_lm_loss": 6.612, "tokens_per_sec": 17706.877, "mfu": 1.078}
    assert format_metrics(bert) == {"loss": 7.164, "train_lm_loss": 6.612, "tok/s": "17.7k", "mfu": "107.8%!"}

    callback = ThroughputCallback()
    callback.peak_tflops, callback._measured = 0.0712, "measured at the start of fit with one float32 matmul"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback._flag_impossible(0.93, 5)
        callback._flag_impossible(1.078, 10)
        callback._flag_impossible(1.2, 15)  # once
    [warning] = [str(w.message) for w in caught]
    assert "mfu 1.078 at step 10 is above 1, which is impossible" in warning and "0.0712 TFLOP/s" in warning
    assert "set peak_tflops" in warning, warning

    (tmp_path / "metrics.csv").write_text("epoch,step,loss,mfu\n0,0,0.7,0.9\n0,1,0.6,1.05\n0,2,0.5,1.08\n")
    trainer = SimpleNamespace(fast_dev_run=False, loggers=[type("CSVLogger", (), {"log_dir": str(tmp_path)})()],
                              checkpoint_callbacks=[])
    assert "median over steps 0-2: 1.065   (above 1: impossible" in run_summary(trainer)


def test_wandb_evaluation_joins_the_history_at_the_checkpoint_step(tmp_path, monkeypatch):
    """``history_step`` (set by ``validate --log_to_training_run true``): the row goes to that step of the
    resumed run, recorded offline as a resume; Lightning's logger would have passed ``anonymous=None``."""
    from wandb_records import offline_runs

    from lightning_megatron.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), project="p", id="run1", resume="must", history_step=12)
    assert "anonymous" not in logger._wandb_init
    logger.log_metrics({"val_loss": 3.5}, step=0)  # Lightning logs an evaluation at step 0
    logger.experiment.finish()
    [run] = offline_runs(tmp_path / "wandb")
    assert (run.run_id, run.resume, run.resumed, run.steps) == ("run1", True, True, [12])
    assert run.history[0]["val_loss"] == 3.5 and run.history[0]["trainer/global_step"] == 12


def _write_run(folder: Path, header: str, rows: list[str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text("\n".join([header, *rows]) + "\n")
    return folder


def test_plot_groups_runs_by_what_they_measured(tmp_path, capsys):
    """A decoder's and an encoder's runs: two columns (never one panel), the decoder's loss labelled as the
    next-token loss, its lm_loss (equal to the loss) not drawn twice, perplexity for both; a validate's log
    in csv/validate/ is not joined into the training curves."""
    from lightning_megatron.cli import main
    from lightning_megatron.plot import columns, read_run

    gpt, bert = tmp_path / "gpt", tmp_path / "bert"
    _write_run(gpt / "csv" / "version_0", "epoch,step,loss,train_lm_loss,val_loss,val_lm_loss,val_perplexity",
               ["0,4,9.0,9.0,,,", "0,9,8.5,8.5,,,", "0,9,,,8.6,8.6,5431.6"])
    _write_run(gpt / "csv" / "validate" / "version_0", "epoch,step,val_loss,val_lm_loss,val_perplexity",
               ["0,0,8.6,8.6,5431.6"])  # a validate of the checkpoint: logged at step 0
    _write_run(bert / "csv" / "version_0", "epoch,step,loss,train_lm_loss,train_binary_loss,train_mlm_accuracy,"
               "val_loss,val_lm_loss,val_perplexity", ["0,4,11.0,10.3,0.7,0.01,,,", "0,9,10.0,9.4,0.6,0.03,9.9,9.3,10938"])
    runs = [read_run(gpt), read_run(bert)]
    assert runs[0]["loss"] == [(4, 9.0), (9, 8.5)]  # not cut at step 0 by the validate's rows
    figure = columns(runs)
    assert [title for title, _ in figure] == ["next-token LM (decoder)", "masked LM (encoder)"]
    (_, decoder), (_, encoder) = figure
    assert [(q, label, sorted(curves)) for q, label, curves in decoder] == [
        ("loss", "next-token loss", [0]), ("perplexity", "perplexity", [0])]
    assert [label for _, label, _ in encoder] == ["total loss (MLM + SOP/NSP)", "masked-LM loss", "SOP/NSP loss",
                                                 "masked-LM accuracy", "masked-LM perplexity"]
    [(q, _, curves)] = [p for p in decoder if p[0] == "perplexity"]
    train, val = curves[0]
    assert train[0] == (4, pytest.approx(8103.08, rel=1e-4)) and val == [(9, 5431.6)]  # exp(loss); the logged value
    # a classifier's fine-tuning (finetune fit): its loss, accuracy and the split's scores, in a column of its own
    cls = tmp_path / "cls"
    _write_run(cls / "csv" / "version_0", "epoch,step,loss,train_accuracy,val_loss,val_accuracy,val_f1",
               ["0,9,2.1,0.19,,,", "0,19,1.5,0.44,1.6,0.41,0.37"])
    figure = columns([read_run(gpt), read_run(bert), read_run(cls)])
    assert [title for title, _ in figure][2] == "classifier (fine-tuning)"
    assert [(q, label, sorted(curves)) for q, label, curves in figure[2][1]] == [
        ("loss", "loss", [2]), ("accuracy", "accuracy", [2]), ("f1", "F1", [2])]
    main(["plot", str(gpt), str(bert), str(cls), "--output", str(tmp_path / "curves.png")])
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decoder_data_says_no_test_split_when_a_test_asks_for_it():
    """The built-in corpus's test split (1 in 1000 documents) holds no 129-token sample: said once, by the
    loader that needs it, not by every setup (``predict`` of prompts and ``check`` used to say it per rank)."""
    from lightning_megatron.datamodules.gpt import GPTDataModule

    dm = GPTDataModule(seq_length=128, global_batch_size=4, micro_batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("predict")
    assert dm.test_dataset is None and not [w for w in caught if "dataset" in str(w.message)], caught
    with pytest.warns(UserWarning, match="no test dataset: the documents hold .* fewer than seq_length"):
        assert dm.test_dataloader() == []


@pytest.mark.parametrize("command,why", [("fit", "fit continues the W&B run of its checkpoint already"),
                                         ("predict", "predict logs no metrics")])
def test_log_to_training_run_is_refused_where_it_means_nothing(tmp_path, command, why):
    from lightning_megatron.cli import main

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "bert_tiny.yaml"
    with pytest.raises(SystemExit, match=f"--log_to_training_run is for validate and test: {why}"):
        main([command, "--config", str(recipe), "--trainer.default_root_dir", str(tmp_path),
              "--log_to_training_run", "true"])
