"""The ``lightning-megatron`` command.

    lightning-megatron fit --config recipes/bert_tiny.yaml [--trainer.max_steps 50 ...]
    lightning-megatron validate|test|predict --config ... --ckpt_path CKPT
    lightning-megatron preprocess --input a.txt b.jsonl.gz dir/ --output-prefix data/my_corpus [--workers 2]
    lightning-megatron preprocess --input docs.jsonl --tokenizer tok/ --append-eod --output-prefix data/gpt
    lightning-megatron train-tokenizer --input a.txt --vocab-size 8192 --output-dir tok/ [--type bpe]
    lightning-megatron plot RUN_DIR [RUN_DIR ...] --output curves.png
    lightning-megatron check --config recipes/bert_tiny.yaml --layouts tp2,pp2,dp2 [--estimate-memory]
    lightning-megatron export hf --ckpt_path CKPT --output DIR [--vocab_file vocab.txt] [--model-class C]
    lightning-megatron export peft --ckpt_path LORA_CKPT --output DIR     (a LoRA run's adapters, PEFT's format)
    lightning-megatron ... --allow-unverified-checkpoint     (any command: checkpoints without checksums load)

fit/validate/test/predict are LightningCLI subcommands over BertLightningModule and BertDataModule,
or over any LightningModule and LightningDataModule named by class path (``--model.class_path
my_pkg.MyModule``, ``--data.class_path ...``, or ``class_path:`` in the recipe's ``model:`` / ``data:``
section: LightningCLI's subclass mode), so every argument of the Trainer, the strategy, the model and
the data is a dotted override. The
Megatron callbacks are named argument groups: ``--megatron_optimizer.clip_grad 0.5``,
``--lr_schedule.lr_warmup_steps 10`` (recipes configure them in those sections; ``--lr_schedule null``
drops one). ``--optimizer torch.optim.SGD --optimizer.momentum 0.9`` and ``--lr_scheduler ...`` take
any torch optimizer and LR scheduler as LightningCLI does, built by the model on its parameter groups
(a :class:`~lightning_megatron.module.MegatronLightningModule`: ``use_optimizer`` / ``use_lr_scheduler``).
Logs and checkpoints go under ``trainer.default_root_dir``; W&B continues the run of a checkpoint.
That LightningCLI is built in :mod:`lightning_megatron.cli_lightning`; the other commands are plain
functions here, in ``COMMANDS`` (name -> (function(argv), one-line help)).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from pathlib import Path
from typing import Any

from lightning_megatron.cli_lightning import finetune_cli, leave_in_order, lightning_cli

__all__ = ["main", "finetune_cli", "plot_runs", "COMMANDS"]


def plot_runs(*args: Any, **kwargs: Any) -> Path:
    """:func:`lightning_megatron.plot.plot_runs` (kept here for existing imports)."""
    from lightning_megatron.plot import plot_runs as plot

    return plot(*args, **kwargs)


_LIGHTNING_COMMANDS = {
    "fit": "train (and validate every val_check_interval steps)",
    "validate": "validation loss of a checkpoint (--ckpt_path)",
    "test": "test-split loss of a checkpoint (--ckpt_path)",
    "predict": "masked-LM ids, pooled or per-token embeddings (--model.predict_output) of a checkpoint; a "
               "decoder's continuations of --data.predict_file",
}


def _preprocess(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="lightning-megatron preprocess",
                                     description="text/jsonl/Hugging Face corpus -> Megatron indexed dataset "
                                                 "(.bin/.idx, and .vocab.json recording the vocabulary)")
    parser.add_argument("--input", nargs="*", default=None,
                        help=".txt (blank line between documents) or .jsonl files, also .gz, directories "
                             "(recursive) or saved Hugging Face datasets; none: the built-in corpus")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--vocab-file", default=None, help="WordPiece vocab.txt (default: the packaged BERT vocab)")
    parser.add_argument("--tokenizer", default=None,
                        help="any vocabulary: a BPE or WordPiece tokenizer.json, GPT-2 vocab.json (merges.txt beside "
                             "it), vocab.txt, or a folder holding one; BPE: one item per document (GPT data)")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every document with the BPE tokenizer's end-of-document token (Megatron's flag)")
    parser.add_argument("--add-special-tokens", action="store_true",
                        help="BPE: encode as transformers' tokenizer(text) does, with the special tokens the "
                             "tokenizer.json's post-processor adds (Llama's BOS; megatron-core's "
                             "--tokenizer-hf-include-special-tokens)")
    parser.add_argument("--json-key", default="text", help="JSON field / dataset column holding the text")
    parser.add_argument("--max-seq-length", type=int, default=512,
                        help="WordPiece sentences longer than this minus 3 are split (BPE documents never are)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = parser.parse_args(argv)
    if a.vocab_file is not None and a.tokenizer is not None:
        parser.error(f"--vocab-file {a.vocab_file} and --tokenizer {a.tokenizer}: pass one of them")
    from lightning_megatron.data.preprocess import preprocess_corpus

    try:
        stats = preprocess_corpus(a.input, a.output_prefix, a.tokenizer or a.vocab_file, json_key=a.json_key,
                                  max_seq_length=a.max_seq_length, workers=a.workers, append_eod=a.append_eod,
                                  add_special_tokens=a.add_special_tokens, progress=not a.no_progress)
    except (ValueError, OSError, ImportError) as error:
        parser.exit(2, f"lightning-megatron preprocess: error: {error}\n")
    for k, v in stats.as_dict().items():
        print(f"{k}: {v}")
    print(f"throughput: {stats.text_bytes / 1e6 / max(stats.seconds, 1e-9):.2f} MB/s")


def _train_tokenizer(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False,
                                     prog="lightning-megatron train-tokenizer",
                                     description="train a WordPiece vocab.txt (BERT) or a byte-level BPE "
                                                 "tokenizer.json (GPT, with <|endoftext|>)")
    parser.add_argument("--type", choices=("wordpiece", "bpe"), default="wordpiece")
    parser.add_argument("--input", nargs="*", default=None, help="text/jsonl files (also .gz), directories or saved Hugging Face datasets; none: the built-in corpus")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--json-key", default="text", help="JSON field / dataset column holding the text")
    parser.add_argument("--cased", action="store_true",
                        help="WordPiece: keep case and accents (Megatron's BertWordPieceCase); default: lowercased")
    a = parser.parse_args(argv)
    if a.cased and a.type == "bpe":
        parser.error("--cased is WordPiece's: a byte-level BPE never lowercases")
    from lightning_megatron.data.bpe_tokenizer import train_bpe_tokenizer
    from lightning_megatron.data.tokenizer import train_wordpiece_tokenizer

    train = train_bpe_tokenizer if a.type == "bpe" else functools.partial(train_wordpiece_tokenizer,
                                                                          lowercase=not a.cased)
    try:
        print(train(a.input, a.vocab_size, a.output_dir, json_key=a.json_key))
    except (ValueError, OSError, ImportError) as error:
        parser.exit(2, f"lightning-megatron train-tokenizer: error: {error}\n")


def _plot(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="lightning-megatron plot",
                                     description="curves of run folders -> PNG: one panel per quantity, one line per "
                                                 "run (resumes joined), validation as markers")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--output", default="loss_curves.png")
    a = parser.parse_args(argv)
    from lightning_megatron.plot import plot_runs

    try:
        print(plot_runs(a.runs, a.output))
    except (ValueError, OSError) as error:
        parser.exit(2, f"lightning-megatron plot: error: {error}\n")


def _export(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="lightning-megatron export",
                                     description="a checkpoint (any TP/PP/DP layout) -> a Hugging Face folder")
    parser.add_argument("format", choices=["hf", "peft"],
                        help="hf: transformers BertForPreTraining (post-norm spec), MegatronBertForPreTraining "
                             "(pre-norm, the default recipe), a fine-tuned classifier's *ForSequenceClassification, "
                             "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
                             "Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or GPT2LMHeadModel (GPT family, by its "
                             "settings; a LoRA checkpoint's adapters merged into its base); peft: a LoRA checkpoint's "
                             "adapters as a PEFT folder (PeftModel.from_pretrained)")
    parser.add_argument("--ckpt_path", required=True, help="a lightning_megatron checkpoint directory")
    parser.add_argument("--output", required=True, help="the folder to write (config, model.safetensors, tokenizer)")
    parser.add_argument("--vocab_file", default=None,
                        help="the vocab.txt the model was trained with (default: the one the checkpoint names)")
    parser.add_argument("--tokenizer", default=None, help="GPT family: the tokenizer.json (or GPT-2 vocab.json) "
                                                          "the model was trained with (default: the checkpoint's)")
    parser.add_argument("--model-class", default=None,
                        help="the module class that wrote the checkpoint (package.module.Class), whose interop "
                             "adapter exports it; default: the class the checkpoint records, else "
                             "BertLightningModule (checkpoints written before they recorded it)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output folder")
    a = parser.parse_args(argv)
    from lightning_megatron.checkpoint import CheckpointError
    from lightning_megatron.export import export_hf, export_peft
    from lightning_megatron.interop.hf_folder import import_transformers

    try:
        if a.format == "peft":
            print(export_peft(a.ckpt_path, a.output, overwrite=a.overwrite))
            return
        import_transformers("exporting a Hugging Face folder")  # before anything is read
        print(export_hf(a.ckpt_path, a.output, vocab_file=a.vocab_file, overwrite=a.overwrite, tokenizer=a.tokenizer,
                        model_class=a.model_class))
    except (CheckpointError, OSError, ValueError, ImportError) as error:
        parser.exit(1, f"lightning-megatron export: error: {error}\n")


def _finetune(argv: list[str]) -> None:
    leave_in_order(finetune_cli(argv))


def _check(argv: list[str]) -> None:
    from lightning_megatron.check.cli import main as check_main  # layout parity and memory per rank

    sys.exit(check_main(argv))


COMMANDS = {
    "check": (_check, "prove layouts equal one process, estimate memory: check --config RECIPE --layouts tp2,pp2"),
    "preprocess": (_preprocess, "text/jsonl corpus -> Megatron indexed dataset (.bin/.idx)"),
    "train-tokenizer": (_train_tokenizer, "train a WordPiece vocabulary or a byte-level BPE tokenizer"),
    "plot": (_plot, "loss curves of run directories -> PNG"),
    "finetune": (_finetune, "fit|validate|test|predict a classifier (finetune fit --config "
                            "recipes/bert_tiny_finetune.yaml) or a decoder with SFT / LoRA "
                            "(finetune fit --config recipes/gpt_tiny_lora.yaml)"),
    "export": (_export, "checkpoint (any layout) -> Hugging Face folder: export hf --ckpt_path CKPT --output DIR"),
}
"""Commands besides LightningCLI's: name -> (function taking the remaining argv, one-line help)."""


def _print_help() -> None:
    lines = ["usage: lightning-megatron COMMAND [options]   (COMMAND --help for its options)", "", "commands:"]
    for name, text in {**_LIGHTNING_COMMANDS, **{k: v[1] for k, v in COMMANDS.items()}}.items():
        lines.append(f"  {name:16s} {text}")
    lines += ["", "fit/validate/test/predict take --config recipes/bert_tiny.yaml and dotted overrides "
              "(--trainer.max_steps 50, --model.config.hidden_size 256, --megatron_optimizer.clip_grad 0.5, ...).",
              f"{ALLOW_UNVERIFIED_FLAG} (any command): load checkpoints that carry no checksums (format 1)."]
    print("\n".join(lines))


ALLOW_UNVERIFIED_FLAG = "--allow-unverified-checkpoint"
"""Any command: load checkpoints without checksums (format 1, checksums removed), with a warning; sets
``LIGHTNING_MEGATRON_ALLOW_UNVERIFIED_CHECKPOINT=1`` for this process and the ranks it starts."""


def _take_allow_unverified(argv: list[str]) -> list[str]:
    """``argv`` without :data:`ALLOW_UNVERIFIED_FLAG`; when it was there, the opt-in is set in the
    environment, which the ranks Lightning or torchrun start inherit (they re-read ``sys.argv`` too)."""
    if ALLOW_UNVERIFIED_FLAG not in argv:
        return argv
    from lightning_megatron.checkpoint import ALLOW_UNVERIFIED_ENV

    os.environ[ALLOW_UNVERIFIED_ENV] = "1"
    return [a for a in argv if a != ALLOW_UNVERIFIED_FLAG]


def _filter_dependency_noise(argv: list[str]) -> None:
    """Filter what dependencies print on every run that asks nothing of a user, narrowly (by message and
    origin) and only in this process: the entry point of the command (``argv``: its arguments), never at import
    (a library leaves process-wide filters alone). Each filter names its reason; everything else is shown."""
    import logging
    import warnings

    # torch >= 2.10 deprecates constructing `LeafSpec`, which Lightning 2.6's CombinedLoader still does at
    # the start of every loop (a FutureWarning per loader): nothing a user can change.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    # Lightning cannot inject drop_last=False into a batch sampler of its own kind and warns that
    # prediction may miss samples; ours pad the last global batch (of each prompt length) and yield every
    # sample once (tests/test_gpt_predict.py, tests/test_cli_recipes.py).
    warnings.filterwarnings("ignore", message=r"You are using a custom batch sampler "
                                              r"`(LengthGroupedBatchSampler|PredictBatchSampler)`",
                            module=r"lightning\.pytorch\.utilities\.data")
    # ModelCheckpoint's "Checkpoint directory ... exists and is not empty": the only fit this command lets into a
    # folder holding checkpoints resumes the run they belong to (cli_config: one run per checkpoint folder; another
    # run's there is refused or named), where that is expected.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty\.",
                            module=r"lightning\.pytorch\.callbacks\.model_checkpoint")
    # ModelCheckpoint's "The dirpath has changed from ...": a checkpoint evaluated or predicted from into another
    # run folder (every predict of a run's checkpoint into its own folder): its best-k bookkeeping is a fit's.
    command = argv[1:2] if argv[:1] == ["finetune"] else argv[:1]
    if command and command[0] in ("validate", "test", "predict"):
        warnings.filterwarnings("ignore", message=r"The dirpath has changed from ",
                                module=r"lightning\.pytorch\.callbacks\.model_checkpoint")
    # Lightning's tips for its cloud services (litlogger, litmodels), logged at every Trainer start.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_cloud_tip_filter)  # once: same object


def _cloud_tip_filter(record: Any) -> bool:
    """False for Lightning's "💡 Tip: For seamless cloud ..." records (:func:`_filter_dependency_noise`)."""
    return not str(record.msg).startswith("💡 Tip: For seamless cloud")


def _collect_then_freeze() -> None:
    """The ``atexit`` handler registered when the command starts, so it runs after those its run
    registers: collect the garbage now, running its finalizers as any exit does, then freeze what is
    still alive, so that CPython's collections while it tears the ~3,900 imported modules down do not
    walk that heap again (1.4 of the ~1.9 s a rank took to exit after its work on a 2-core host; the
    launching rank waits for the other ranks' exits, then makes its own). What is still alive is freed
    by reference counting as before; a reference cycle still alive then is not finalized (Python does
    not promise it; our files are closed when written, logging's by its own handler, W&B's by its
    teardown, which runs before this)."""
    import gc

    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> None:
    import atexit

    atexit.unregister(_collect_then_freeze)  # once per process, however often main is called
    atexit.register(_collect_then_freeze)  # before the command's own: it runs after them (W&B's teardown too)
    from_sys_argv = argv is None
    argv = _take_allow_unverified(list(sys.argv[1:] if argv is None else argv))
    _filter_dependency_noise(argv)
    if from_sys_argv:
        sys.argv[1:] = argv  # LightningCLI parses sys.argv: it would not know the flag
    if not argv or argv[0] in ("-h", "--help"):
        _print_help()
        return
    from lightning_megatron import launch

    try:
        # A LightningCLI command (finetune too): no garbage collections while it imports; resumed, with what the
        # imports made frozen out of later ones, once they are done (lightning_megatron.launch). Only as the
        # process's command (its arguments from sys.argv): main called with arguments from a program or a test
        # would freeze that process's garbage of the moment too, a dropped model's tensors among it.
        if from_sys_argv and (argv[0] not in COMMANDS or argv[0] == "finetune"):
            launch.pause_collection()
        if argv[0] in COMMANDS:
            COMMANDS[argv[0]][0](argv[1:])
            return
        # From the command line LightningCLI reads sys.argv itself (passing args too makes it warn).
        leave_in_order(lightning_cli(None if from_sys_argv else argv))
    except KeyboardInterrupt:  # Ctrl-C outside Lightning's run (the parse, the classes' build): a line, not a traceback
        print("\nlightning-megatron: stopped by Ctrl-C", file=sys.stderr)
        raise SystemExit(128 + int(signal.SIGINT)) from None  # 130, what a shell reports for Ctrl-C
    except SystemExit as e:
        if e.code == 1 and isinstance(e.__context__, KeyboardInterrupt):  # Lightning's own exit after a Ctrl-C
            raise SystemExit(128 + int(signal.SIGINT)) from None  # 130, as after our stop handler's save
        raise
    except Exception as e:
        # Imported here: `plot`, `preprocess`, `train-tokenizer` and `--help` need no torch.
        from lightning_megatron.checkpoint import CheckpointError
        from lightning_megatron.datamodules.pretraining import NoEvaluationData
        from lightning_megatron.replica_check import ReplicaGradientError
        from lightning_megatron.run_lock import RunFolderBusy
        from lightning_megatron.step import NonFiniteLossOrGradError

        from lightning_megatron.communicator import peer_lost

        lost = None if isinstance(e, CheckpointError) else peer_lost(e)
        if lost is not None:  # another rank's process is gone: its own output says why; this one's traceback cannot
            from lightning.pytorch.utilities import rank_zero_only

            raise SystemExit(f"lightning-megatron: rank {getattr(rank_zero_only, 'rank', 0)}: another rank died or "
                             f"stopped answering "
                             f"({lost}), {_where(e)}: this rank stops; the cause is in that rank's own output above "
                             f"(an error, a kill, the kernel's out-of-memory killer)") from None
        if not isinstance(e, (CheckpointError, NonFiniteLossOrGradError, NoEvaluationData, ReplicaGradientError,
                              RunFolderBusy)):
            raise
        # Every rank raises it (the ranks agree on the decision before raising): rank 0 says it once, in
        # one line (a full disk was ~240 lines and 10 tracebacks), the others exit quietly.
        from lightning.pytorch.utilities import rank_zero_only

        if rank_zero_only.rank != 0:
            raise SystemExit(1) from None
        raise SystemExit(f"lightning-megatron: {e}") from None
    finally:
        launch.resume_collection()  # a command that ended before its imports were done
        if "lightning_megatron.run_lock" in sys.modules:  # the run folder's lock, held while the command ran
            sys.modules["lightning_megatron.run_lock"].release_run_locks()


def _where(error: BaseException) -> str:
    """``in FUNCTION (FILE:LINE)`` of the innermost frame of ``error``'s traceback outside torch and Lightning (what
    this rank was doing), else of the innermost one."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    theirs = ("/torch/", "/lightning/", "/lightning_fabric")
    ours = [f for f in frames if not any(part in f.filename for part in theirs)]
    frame = (ours or frames or [None])[-1]
    return f"in {frame.name} ({frame.filename}:{frame.lineno})" if frame is not None else "here"


if __name__ == "__main__":
    main()
