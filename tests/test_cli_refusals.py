"""Bad inputs of the decoder, predict, fine-tuning and check surfaces (issue 34), through the real CLI.

Each row runs ``lightning-megatron ...`` in this process (``lightning_megatron.cli.main``, as the console
script calls it) and must be refused before any process is launched: the exit it gets (the CLI's one
ConfigError listing the problems, or argparse's usage error), every text the message must hold (the
value, the file, the fix) and none of the ones the old refusals gave. Nothing is launched: no process
group is created and the run folder is never made.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from dist_utils import DistributedTestFailure, run_distributed

from lightning_megatron.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "recipes" / "gpt_tiny.yaml")
SST2 = str(ROOT / "recipes" / "bert_tiny_sst2.yaml")
BEFORE_LAUNCH = "configuration problem(s), found before launching any process"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The files the rows name: a GPT dataset made with the packaged BPE (its record names it), prompts
    (plain, too long for the positions, Latin-1), fine-tuning files (good, empty, a label id outside the
    classes)."""
    from lightning_megatron.data.bpe_tokenizer import BPETokenizer
    from lightning_megatron.data.preprocess import preprocess_corpus

    d = tmp_path_factory.mktemp("refusals")
    text = "\n\n".join(f"Document {i} is about tensor parallel layers.\nIt splits the weights." for i in range(40))
    (d / "docs.txt").write_text(text + "\n")
    preprocess_corpus([d / "docs.txt"], d / "gpt", BPETokenizer(), append_eod=True, progress=False)
    preprocess_corpus([d / "docs.txt"], d / "noeod", BPETokenizer(), progress=False)  # without --append-eod
    preprocess_corpus([d / "docs.txt"], d / "wordpiece", progress=False)  # BERT's packaged WordPiece
    (d / "prompts.txt").write_text("The function returns\nA list of\n")
    from lightning_megatron.data.tokenizer import SPECIAL_TOKENS, train_wordpiece_tokenizer

    # a WordPiece vocabulary with 20 pieces the data never uses past its own: the data's largest id is below 290
    vocab = train_wordpiece_tokenizer([d / "docs.txt"], 200, d / "extra")
    pieces = vocab.read_text(encoding="utf-8").splitlines()
    vocab.write_text("\n".join(pieces + [f"unused{i}" for i in range(20)]) + "\n", encoding="utf-8")
    preprocess_corpus([d / "docs.txt"], d / "extra_data", vocab, progress=False)
    (d / "extra" / "small_vocab_size").write_text(str(len(pieces)))
    (d / "nomask").mkdir()  # a BERT vocabulary without [MASK]
    (d / "nomask" / "vocab.txt").write_text("\n".join([t for t in SPECIAL_TOKENS if t != "[MASK]"]
                                                      + pieces[len(SPECIAL_TOKENS):]) + "\n", encoding="utf-8")
    (d / "link.yaml").write_text(f"base: {ROOT / 'recipes' / 'bert_tiny.yaml'}\ntrainer:\n  callbacks:\n"
                                 f"  - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n    init_args:\n"
                                 f"      save_last: link\n")
    (d / "long.txt").write_text("The function returns\n" + " ".join(["word"] * 60) + "\n")  # 60 tokens
    (d / "latin1.txt").write_bytes(b"The function returns\ncaf\xe9 au lait\n")
    rows = [{"sentence": f"a fine film number {i}", "label": ["negative", "positive"][i % 2]} for i in range(40)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "empty.jsonl").write_text("\n")
    (d / "small.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    ids = [{"sentence": r["sentence"], "label": i % 2} for i, r in enumerate(rows)]
    ids[30]["label"] = 7
    (d / "ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ids))
    chat = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    (d / "chats.jsonl").write_text(json.dumps(chat) + "\n" + json.dumps(chat) + "\n")
    (d / "one_chat.jsonl").write_text(json.dumps(chat) + "\n")
    (d / "no_answer.jsonl").write_text(json.dumps(chat) + "\n" + json.dumps({"messages": chat["messages"][:1]}) + "\n")
    import transformers  # a Mixtral folder's config.json: what the CLI reads of init_from before launch

    transformers.MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=8192,
                               max_position_embeddings=128).save_pretrained(d / "mixtral")
    transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=8192, max_position_embeddings=128).save_pretrained(
        d / "llama")
    transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=97, max_position_embeddings=128).save_pretrained(
        d / "llama97")  # a vocabulary smaller than the packaged BPE's
    transformers.BertConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=128).save_pretrained(d / "bert")
    import shutil

    from lightning_megatron.data.tokenizer import packaged_vocab_file

    shutil.copytree(d / "bert", d / "bert_own_vocab")  # a BERT with a vocabulary of its own, of the packaged size
    pieces = packaged_vocab_file().read_text(encoding="utf-8").splitlines()
    pieces[2000:2010] = reversed(pieces[2000:2010])
    (d / "bert_own_vocab" / "vocab.txt").write_text("\n".join(pieces) + "\n", encoding="utf-8")
    shutil.copy(packaged_vocab_file(), d / "bert" / "vocab.txt")  # the packaged vocabulary: nothing to say
    from lightning_megatron.data.bpe_tokenizer import packaged_bpe_tokenizer_file

    shutil.copytree(d / "llama", d / "llama_own_tokenizer")  # the packaged BPE with two pieces' ids swapped
    spec = json.loads(packaged_bpe_tokenizer_file().read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (d / "llama_own_tokenizer" / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    shutil.copytree(d / "llama", d / "llama_bos")  # the packaged BPE whose post-processor puts a BOS first (Llama 3's)
    spec = json.loads(packaged_bpe_tokenizer_file().read_text(encoding="utf-8"))
    eod = spec["model"]["vocab"]["<|endoftext|>"]
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [eod], "tokens": ["<|endoftext|>"]}}}
    (d / "llama_bos" / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    bos_tokenizer = str(d / "llama_bos" / "tokenizer.json")
    preprocess_corpus([d / "docs.txt"], d / "no_bos", bos_tokenizer, append_eod=True, progress=False)
    preprocess_corpus([d / "docs.txt"], d / "with_bos", BPETokenizer(bos_tokenizer, add_special_tokens=True),
                      append_eod=True, add_special_tokens=True, progress=False)
    shutil.copytree(d / "bert", d / "bert_own_tokenizer")  # the same, as a tokenizer.json only
    (d / "bert_own_tokenizer" / "vocab.txt").unlink()
    from tokenizers.implementations import BertWordPieceTokenizer

    BertWordPieceTokenizer(str(d / "bert_own_vocab" / "vocab.txt"), lowercase=True).save(
        str(d / "bert_own_tokenizer" / "tokenizer.json"))
    return {"dir": str(d), "gpt": str(d / "gpt"), "noeod": str(d / "noeod"), "wordpiece": str(d / "wordpiece"),
            "mixtral": str(d / "mixtral"), "llama": str(d / "llama"), "llama97": str(d / "llama97"),
            "bert": str(d / "bert"),
            "bert_own_vocab": str(d / "bert_own_vocab"), "bert_own_tokenizer": str(d / "bert_own_tokenizer"),
            "prompts": str(d / "prompts.txt"), "link_recipe": str(d / "link.yaml"),
            "llama_own_tokenizer": str(d / "llama_own_tokenizer"), "llama_bos": str(d / "llama_bos"),
            "no_bos": str(d / "no_bos"), "with_bos": str(d / "with_bos"),
            "extra_data": str(d / "extra_data"), "extra_small": (d / "extra" / "small_vocab_size").read_text(),
            "extra_pieces": str(int((d / "extra" / "small_vocab_size").read_text()) + 20),
            "nomask_vocab": str(d / "nomask" / "vocab.txt"),
            "long": str(d / "long.txt"),
            "latin1": str(d / "latin1.txt"), "train": str(d / "train.jsonl"), "empty": str(d / "empty.jsonl"),
            "small": str(d / "small.jsonl"),
            "ids": str(d / "ids.jsonl"), "nope": str(d / "nope.ckpt"), "chats": str(d / "chats.jsonl"),
            "one_chat": str(d / "one_chat.jsonl"), "no_answer": str(d / "no_answer.jsonl")}


FIT, PREDICT = ["fit", "--config", GPT], ["predict", "--config", GPT, "--data.predict_file", "{prompts}"]
FINETUNE = ["finetune", "fit", "--config", SST2, "--data.init_args.validation", "{train}"]
SFT = ["finetune", "fit", "--config", str(ROOT / "recipes" / "gpt_tiny_lora.yaml"),
       "--model.init_args.init_from", "null", "--model.init_args.lora", "null"]
"""A decoder's fine-tuning on chats (SFTDataModule); the recipe's base is not needed to refuse its data."""

CASES = {
    # (argv, exit code (None: the CLI's one-line ConfigError), texts the message holds, texts it must not hold)
    "gpt_data_prefix_vocab_null": (  # the dataset's record names its BPE: not "another vocabulary" (the
        # refusal here is the timeout, to stop before launch)
        [*FIT, "--data.data_prefix", "{gpt}", "--trainer.strategy.init_args.timeout", "0"], None,
        ["1 configuration problem(s)", "strategy timeout=0"], ["another vocabulary", "bert-base-uncased"]),
    # GPT on data it cannot read: refused after launch, by a rank (the WordPiece data's fix named --append-eod, which
    # WordPiece refuses); the timeout row stops the launch should the data be let through
    "gpt_on_wordpiece_data": (
        [*FIT, "--data.data_prefix", "{wordpiece}", "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "dataset '{wordpiece}' was tokenized with a WordPiece (BERT) vocabulary, and "
         "`preprocess` ends no WordPiece document with an end-of-document id", "preprocess the text with a byte-level "
         "BPE tokenizer: `lightning-megatron preprocess --input TEXT --output-prefix PREFIX --tokenizer "
         "tokenizer.json --append-eod`"], []),
    "gpt_data_without_eod": (
        [*FIT, "--data.data_prefix", "{noeod}", "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "dataset '{noeod}' was preprocessed without --append-eod: GPT samples join "
         "documents", "`lightning-megatron preprocess --input TEXT --output-prefix {noeod} --tokenizer "], []),
    "gpt_seq_length_beyond_the_data": (  # refused by a rank's traceback after launch, naming no dataset
        [*FIT, "--data.data_prefix", "{gpt}", "--data.seq_length", "2048", "--model.config.max_sequence_length",
         "2048", "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "data seq_length=2048: dataset '{gpt}' holds ", " tokens in all, fewer than "
         "one sample's seq_length + 1 = 2049; use more text or a shorter seq_length"], []),
    "gpt_seq_length": ([*FIT, "--data.seq_length", "256"], None,
                       ["data seq_length=256 exceeds the model's max_sequence_length=128"], []),
    "predict_temperature": ([*PREDICT, "--model.predict_greedy", "false", "--model.predict_temperature", "0"], None,
                            ["--model.predict_temperature=0.0 must be > 0"], []),
    "predict_top_p": ([*PREDICT, "--model.predict_greedy", "false", "--model.predict_top_p", "1.5"], None,
                      ["--model.predict_top_p=1.5 must be in (0, 1]"], []),
    "predict_positions": ([*PREDICT[:-1], "{long}", "--model.predict_max_new_tokens", "100"], None,
                          ["--model.predict_max_new_tokens=100: the longest prompt of predict_file '{long}' (line "
                           "2, 60 tokens) followed by 100 new tokens needs 159 positions, more than the model's "
                           "max_sequence_length=128; generate at most 69 new tokens"], ["raise max_sequence_length"]),
    "predict_non_utf8": ([*PREDICT[:-1], "{latin1}"], None,
                         ["predict_file '{latin1}' is not UTF-8 text: byte 24 (line 2)"], ["UnicodeDecodeError"]),
    "test_split_without_documents": (  # 40 documents: the test split's 1/1000 is none of them
        ["test", "--config", GPT, "--data.data_prefix", "{gpt}"], None,
        ["data splits='949,50,1' gives the test split none of the 40 documents of {gpt}: `test` would have "
         "nothing to read; give it more documents or a larger weight"], ["Total length"]),
    "test_split_shorter_than_a_sample": (  # 2 documents, no sample of seq_length + 1 tokens: `test` tested nothing
        ["test", "--config", GPT, "--data.data_prefix", "{gpt}", "--data.splits", "90,5,5",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["3 configuration problem(s)", "data splits='90,5,5' gives the test split 2 of the 40 documents of {gpt}, "
         "holding ", " tokens: fewer than one sample's seq_length + 1 = 129; `test` would have nothing to read"], []),
    "validate_split_weight_zero": (
        ["validate", "--config", GPT, "--data.data_prefix", "{gpt}", "--data.splits", "100,0,0"], None,
        ["data splits='100,0,0' gives the valid split none of the 40 documents"], []),
    # where the run writes: a file there, or a folder that cannot be written, failed at the first save (after as
    # many steps as its interval: 200 in the recipes), or after launch with a rank's traceback for the logs' folder
    "root_dir_is_a_file": ([*FIT, "--trainer.default_root_dir", "{latin1}", "--trainer.strategy.init_args.timeout",
                            "0"], None,
                           ["--trainer.default_root_dir {latin1} is a file, not a folder: the run writes its logs "
                            "and checkpoints there; pass a folder"], []),
    "checkpoint_dir_under_a_file": (
        [*FIT, "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath", "{latin1}/ckpts",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["the checkpoint folder {latin1}/ckpts cannot be made: {latin1} is a file, not a folder"], []),
    "per_split_data_prefix_path_missing": (  # a dataset per split (YAML's mapping on the command line): each found
        [*FIT, "--data.data_prefix", "{{train: {gpt}, valid: {nope}}}", "--trainer.strategy.init_args.timeout", "0"],
        None, ["2 configuration problem(s)", "data data_prefix='{nope}': '{nope}.bin' and '{nope}.idx' not found"],
        []),
    "validate_per_split_without_valid": (
        ["validate", "--config", GPT, "--data.data_prefix", "{{train: {gpt}}}"], None,
        ["data data_prefix names no valid dataset (train): `validate` would have nothing to read; add "
         "data_prefix.valid"], []),
    "per_split_data_prefix_with_splits": (
        [*FIT, "--data.data_prefix", "{{train: {gpt}, validation: {gpt}}}", "--data.splits", "90,5,5"], None,
        ["data_prefix: 'validation' is not a split: use train, valid and test (valid is the validation split)"], []),
    "predict_split_without_documents": (  # predicting the test split: its own refusal names predict_file
        ["predict", "--config", GPT, "--data.data_prefix", "{gpt}"], None,
        ["gives the test split none of the 40 documents of {gpt}: `predict` would have nothing to read; give it "
         "more documents or a larger weight, or pass --data.predict_file"], []),
    "predict_ckpt_not_a_checkpoint": (  # a folder without the marker: refused before the ranks start, not after
        [*PREDICT, "--ckpt_path", "{dir}"], None,
        ["checkpoint '{dir}' is incomplete: lightning_megatron.json is missing"], ["Restoring states"]),
    "predict_missing_ckpt": ([*PREDICT, "--ckpt_path", "{nope}"], None, ["ckpt_path='{nope}' does not exist"], []),
    "finetune_empty_file": ([*FINETUNE, "--data.init_args.train", "{empty}"], None,
                            ["data.train '{empty}' is empty: it holds no rows"], ["no 'train' split"]),
    "finetune_label_outside_classes": (
        [*FINETUNE, "--data.init_args.train", "{ids}", "--data.init_args.labels", "null",
         "--data.init_args.num_classes", "2", "--data.init_args.validation", "{ids}"], None,
        ["2 configuration problem(s)", "data.train '{ids}' row 31: label 7 is outside the classes 0..1 "
         "(data.num_classes=2)", "data.validation '{ids}' row 31: label 7"], []),
    "finetune_fewer_rows_than_a_batch": (  # every rank raised it once started
        [*FINETUNE, "--data.init_args.train", "{small}"], None,
        ["data: the train split has 20 rows and global_batch_size=32: a training step needs a full global batch"],
        []),
    "finetune_regression_with_labels": (  # the rows were read against the names first, contradicting itself
        [*FINETUNE, "--data.init_args.train", "{train}", "--data.init_args.task", "regression"], None,
        ["task='regression' predicts one value: drop data.labels=['negative', 'positive']"], ["is not one of"]),
    "finetune_regression_label_not_a_number": (
        [*FINETUNE, "--data.init_args.train", "{train}", "--data.init_args.task", "regression",
         "--data.init_args.labels", "null", "--data.init_args.num_classes", "null"], None,
        ["data.train '{train}' row 1: label 'negative' is not a number (task='regression': the value to predict)"],
        ["class id"]),
    "finetune_classes_against_labels": (  # the line named the section twice: "data data.num_classes=3 ..."
        [*FINETUNE, "--data.init_args.train", "{train}", "--data.init_args.num_classes", "3"], None,
        ["  - data.num_classes=3 but data.labels names 2 classes ['negative', 'positive']"], ["data data."]),
    "finetune_label_key": ([*FINETUNE, "--data.init_args.train", "{train}", "--data.init_args.label_key", "labl"],
                           None, ["1 configuration problem(s)", "data.train '{train}' row 1 has no column 'labl': "
                                  "its columns are ['label', 'sentence']; set --data.label_key"], []),
    # chat files: each rank raised it after launch, a traceback each (a missing file, a chat without an answer, a
    # split left empty), or jsonargparse printed 83 lines around the datamodule's own message
    "sft_missing_train_file": ([*SFT, "--data.init_args.train_file", "{nope}"], None,
                               ["data.train_file '{nope}' does not exist"], ["Traceback"]),
    "sft_fewer_chats_than_a_batch": (  # every rank raised it once started, a traceback each
        [*SFT, "--data.init_args.train_file", "{chats}", "--data.init_args.val_fraction", "0",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "data: the train split has 2 chats and global_batch_size=8: a training step "
         "needs a full global batch and a chat makes at most one sample; lower data.global_batch_size or give more "
         "chats"], []),
    "sft_chat_without_answer": ([*SFT, "--data.init_args.train_file", "{no_answer}"], None,
                                ["data.train_file '{no_answer}' line 2 has no assistant message (roles ['user'])"], []),
    "sft_val_fraction_of_one_chat": ([*SFT, "--data.init_args.train_file", "{one_chat}"], None,
                                     ["val_fraction=0.1 of 1 records leaves none to train on"], []),
    "sft_validation_file_and_val_fraction": (
        [*SFT, "--data.init_args.train_file", "{chats}", "--data.init_args.validation_file", "{chats}"], None,
        ["validation_file='{chats}' and val_fraction=0.1: use one of the two"], ["Traceback", "jsonargparse"]),
    # check's own arguments: a 0 efficiency was read as "not given" (the default used, exit 0), 0 GPUs per node
    # changed the prediction, tp0 and --steps 0 ended in tracebacks, --gpus 0 printed an empty table and exit 1,
    # --layouts '' compared nothing and printed PASS
    "check_efficiency_zero": (["check", "--config", GPT, "--estimate-time", "--gpus", "8", "--gemm-efficiency", "0"],
                              2, ["argument --gemm-efficiency: 0 is not a fraction in (0, 1]"], []),
    "check_link_efficiency_zero": (["check", "--config", GPT, "--estimate-time", "--link-efficiency", "0"], 2,
                                   ["argument --link-efficiency: 0 is not a fraction in (0, 1]"], []),
    "check_devices_per_node_zero": (["check", "--config", GPT, "--estimate-time", "--devices-per-node", "0"], 2,
                                    ["argument --devices-per-node: 0 is not a whole number >= 1"], []),
    "check_steps_zero": (["check", "--config", GPT, "--layouts", "tp2", "--steps", "0"], 2,
                         ["argument --steps: 0 is not a whole number >= 1"], ["Traceback"]),
    "check_gpus_zero": (["check", "--config", GPT, "--estimate-memory", "--gpus", "0"], 2,
                        ["argument --gpus: 0 is not a whole number >= 1"], []),
    "check_layout_tp0": (["check", "--config", GPT, "--layouts", "tp0"], 2,
                         ["tensor_model_parallel_size=0 must be a positive integer"], ["ZeroDivisionError"]),
    "check_layout_ep0": (["check", "--config", GPT, "--layouts", "ep0"], 2,
                         ["expert_model_parallel_size=0 must be a positive integer"], ["ZeroDivisionError"]),
    "check_no_layouts": (["check", "--config", GPT, "--layouts", " , "], 2,
                         ["--layouts ' , ' names no layout; write e.g. --layouts tp2,pp2,dp2"], []),
    "check_a_layout_twice": (["check", "--config", GPT, "--layouts", "tp2,dp2,tp2"], 2,
                             ["--layouts 'tp2,dp2,tp2' names tp2 twice"], []),
    "check_tp3_with_4_heads": (["check", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--layouts", "tp3"], 2,
                               ["found before starting any process", "layout tp3: model.config: num_attention_heads=4 is not "
                                "divisible by tensor_model_parallel_size=3"], ["DistributedTestFailure"]),
    "check_missing_init_from": (  # a run builds the model from its source: refused before any process starts
        ["check", "--config", str(ROOT / "recipes" / "gpt_tiny_lora.yaml"), "--layouts", "tp2", "--model.init_from",
         "{nope}"], 2,
        ["found before starting any process", "model.init_from='{nope}' does not exist", "--model.init_from"],
        ["DistributedTestFailure", "Traceback"]),
    "num_query_groups_against_tp": (  # the decoder's record at the strategy's TP size (issue 35)
        [*FIT, "--model.init_args.config.num_query_groups", "3"], None,
        ["model.config: num_query_groups=3 must be a number that divides num_attention_heads=4"], []),
    "num_query_groups_not_fitting_tp": (
        [*FIT, "--model.init_args.config.num_attention_heads", "6", "--model.init_args.config.hidden_size", "96",
         "--model.init_args.config.num_query_groups", "3"], None,
        ["1 configuration problem(s)", "num_query_groups=3 must be a multiple or a divisor of "
         "tensor_model_parallel_size=2"], []),
    "context_parallel_on_bert": (  # a module that does not split its sequence (issue 37)
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--trainer.strategy.init_args.context_parallel_size",
         "2", "--trainer.strategy.init_args.tensor_model_parallel_size", "1"], None,
        ["context_parallel_size=2: BertLightningModule does not split its sequence over context-parallel ranks",
         "use context_parallel_size=1"], []),
    "context_parallel_sequence": (  # 2 x CP chunks of the sequence
        [*FIT, "--trainer.strategy.init_args.context_parallel_size", "2", "--trainer.strategy.init_args."
         "tensor_model_parallel_size", "1", "--data.seq_length", "30", "--model.init_args.config.max_sequence_length",
         "32"], None,
        ["sequence length 30 is not divisible by 2 x context_parallel_size = 4"], []),
    "sequence_parallel_sequence_length": (  # every rank raised it at its first step, a traceback each
        [*FIT, "--trainer.strategy.init_args.sequence_parallel", "true", "--data.seq_length", "127"], None,
        ["data sequence length 127 is not divisible by tensor_model_parallel_size=2: sequence parallelism splits "
         "each sequence over the TP ranks; use a multiple of 2"], []),
    "context_parallel_ring_attention_dropout": (  # ring attention has none: every rank raised it at its first step
        [*FIT, "--trainer.strategy.init_args.context_parallel_size", "2", "--trainer.strategy.init_args."
         "tensor_model_parallel_size", "1", "--model.init_args.config.cp_comm_type", "p2p"], None,
        ["cp_comm_type='p2p' (ring attention) has no attention dropout, and attention_dropout=0.1 trains with it"],
        []),
    "context_parallel_a2a_heads": (  # Ulysses splits the heads over CP
        [*FIT, "--trainer.strategy.init_args.context_parallel_size", "2", "--model.init_args.config.cp_comm_type",
         "a2a", "--model.init_args.config.num_attention_heads", "2", "--model.init_args.config.hidden_size", "64"],
        None, ["cp_comm_type='a2a' splits the 1 attention heads of a tensor-parallel rank over "
               "context_parallel_size=2"], []),
    "expert_parallel_without_experts": (  # EP on a dense model (issue 36)
        [*FIT, "--trainer.strategy.init_args.expert_model_parallel_size", "2", "--trainer.strategy.init_args."
         "tensor_model_parallel_size", "1"], None,
        ["expert_model_parallel_size=2 but the model has no experts (num_moe_experts is None)"], []),
    "experts_not_divisible_by_ep": (
        ["fit", "--config", str(ROOT / "recipes" / "moe_tiny.yaml"), "--model.init_args.config.num_moe_experts", "3"],
        None, ["num_moe_experts=3 is not divisible by expert_model_parallel_size=2"], []),
    "expert_tensor_parallel_size": (
        ["fit", "--config", str(ROOT / "recipes" / "moe_tiny.yaml"), "--trainer.strategy.init_args."
         "expert_tensor_parallel_size", "1", "--trainer.strategy.init_args.tensor_model_parallel_size", "2",
         "--trainer.strategy.init_args.expert_model_parallel_size", "1"], None,
        ["expert_tensor_parallel_size=1: an expert tensor-parallel size other than the TP size (2)"], []),
    # a source whose vocabulary is smaller than the data's tokenizer (the built-in corpus in the packaged BPE):
    # refused by every rank's datamodule after launch, advising a vocab_size the source cannot take
    "init_from_vocabulary_smaller_than_the_data_s": (
        ["fit", "--config", GPT, "--model.init_args.init_from", "{llama97}",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "model vocab_size=97 (init_from='{llama97}') is smaller than the data's "
         "tokenizer (the packaged BPE, 8192 pieces)", "data.vocab_file"], []),
    # a model vocabulary smaller than the data's tokenizer, set by hand over a dataset whose ids fit it: BERT's
    # masking drew replacement ids past it (into padded rows at TP=2, unsaid), and no export could name the vocabulary
    "model_vocabulary_smaller_than_the_dataset_tokenizer": (
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--data.data_prefix", "{extra_data}",
         "--model.config.vocab_size", "{extra_small}", "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "model vocab_size={extra_small} is smaller than the data's tokenizer (",
         "the one the data records, {extra_pieces} pieces)", "set model vocab_size to it, or leave it null"], []),
    # the built-in corpus with a BERT vocabulary lacking [MASK]: every rank failed after launch (a traceback each)
    "built_in_corpus_vocabulary_without_mask": (
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--data.vocab_file", "{nomask_vocab}",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "lacks the special tokens ['[MASK]']", "train-tokenizer --type wordpiece"],
        []),
    "lora_on_experts": (  # a mixture of experts' projections take no adapters: refused in every rank after launch
        ["fit", "--config", str(ROOT / "recipes" / "moe_tiny.yaml"), "--model.init_args.lora.rank", "8",
         "--model.init_args.init_from", "{mixtral}"], None,
        ["model.lora.target_modules=['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2'] adapt linear_fc1 and "
         "linear_fc2, which are a mixture of experts' projections in this model (num_moe_experts=4): LoRA adapts "
         "the attention's only here; set --model.lora.target_modules '[linear_qkv, linear_proj]'"], []),
    "zero1_over_an_optimizer_that_is_not_elementwise": (  # ZeRO-1 steps flat pieces of several parameters
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--megatron_optimizer.use_distributed_optimizer",
         "true", "--model.optimizer_class", "torch.optim.Adafactor"], None,
        ["model.optimizer_class='torch.optim.Adafactor' with use_distributed_optimizer=True: Adafactor is not one of "
         "torch's elementwise optimizers", "or use_distributed_optimizer=False"], []),
    # validate / test / predict without a checkpoint evaluated the random initialization, unsaid (a validation loss
    # of ln(vocab), predictions of noise); --model.init_from (pretrained weights) is a model to evaluate. (Each row
    # also sets timeout 0, a second refusal, so that nothing launches should the first be let through.)
    "validate_without_a_checkpoint": (["validate", "--config", GPT, "--trainer.strategy.init_args.timeout", "0"],
                                      None, [
        "2 configuration problem(s)", "validate without --ckpt_path or --model.init_from would evaluate the model's "
        "random initialization: pass --ckpt_path with a checkpoint (a run's checkpoints/last.ckpt, or last for the "
        "run folder's newest), or --model.init_from with pretrained weights"], []),
    "predict_without_a_checkpoint": ([*PREDICT, "--trainer.strategy.init_args.timeout", "0"], None,
                                     ["2 configuration problem(s)", "predict without --ckpt_path or --model.init_from"],
                                     []),
    "validate_init_from_is_a_model": (
        ["validate", "--config", GPT, "--model.init_from", "{llama}", "--trainer.strategy.init_args.timeout", "0"],
        None, ["1 configuration problem(s)", "strategy timeout=0"], ["--ckpt_path"]),
    "finetune_test_init_from_leaves_the_classifier_fresh": (
        ["finetune", "test", "--config", SST2, "--data.init_args.train", "{train}", "--data.init_args.validation",
         "{train}", "--model.init_from", "{bert}", "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "test of BertClassificationModule needs the fine-tuned checkpoint "
         "(--ckpt_path): --model.init_from loads the pretrained weights and leaves classifier.* at its "
         "initialization"], []),
    # null for a number of the schedule passed every check and stopped every rank after its first step
    # ("unsupported operand type(s) for -: 'float' and 'NoneType'"); of clipping, a jsonargparse dump
    # a style misspelled, or a WSD schedule without its decay style: refused before launch (each rank raised it
    # from the scheduler's constructor, a traceback per rank)
    # last.ckpt as a link: Lightning makes it on rank 0 outside the atomic, run-guarded save
    "save_last_link": (["fit", "--config", "{link_recipe}", "--trainer.strategy.init_args.timeout", "0"], None,
                       ["2 configuration problem(s)", "ModelCheckpoint(save_last='link') is not supported",
                        "set save_last: true"], []),
    "schedule_style": (["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--lr_schedule.lr_decay_style",
                        "cosin", "--lr_schedule.wd_incr_style", "cosine", "--lr_schedule.end_wd", "0.001"], None,
                       ["2 configuration problem(s)", "lr_schedule.lr_decay_style='cosin' is not one of",
                        "lr_schedule.end_wd=0.001 must be >= start_wd=0.01"], []),
    "schedule_number_null": (["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--lr_schedule.min_lr",
                              "null", "--lr_schedule.start_wd", "null"], None,
                             ["2 configuration problem(s)", "lr_schedule.min_lr=None: the schedule needs a number "
                              "(leave the key out for the default, 0.0)", "lr_schedule.start_wd=None"], []),
    "clip_grad_null": (["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--megatron_optimizer.clip_grad",
                        "null"], None, ["megatron_optimizer.clip_grad=None: a number is needed (leave the key out for "
                                     "the default, 1.0; 0 disables clipping)"], []),
    "finetune_validate_lora_without_its_checkpoint": (  # the adapters start at zero: it evaluated the base, unsaid
        ["finetune", "validate", "--config", str(ROOT / "recipes" / "gpt_tiny_lora.yaml"),
         "--model.init_args.init_from", "{llama}", "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "validate of GPTLightningModule with model.lora needs the fine-tuned checkpoint "
         "(--ckpt_path): --model.init_from loads the base and the LoRA adapters start at zero, so it would evaluate "
         "the base; pass --ckpt_path, or --model.lora null to evaluate the base itself"], []),
    "post_norm_spec_with_rmsnorm": (  # the spec's LayerNorm was built, the setting ignored, unsaid
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--model.config.spec",
         "bert_layer_post_norm_spec", "--model.config.normalization", "RMSNorm", "--trainer.strategy.init_args.timeout",
         "0"], None,
        ["2 configuration problem(s)", "normalization='RMSNorm' with spec='bert_layer_post_norm_spec': that spec is "
         "Hugging Face BERT's, LayerNorm after each residual branch, and would ignore it; use bert_layer_local_spec "
         "(pre-norm, its norm the config's normalization) or bert_layer_rmsnorm_spec"], []),
    # a BERT whose vocabulary is not the packaged one, trained on text the packaged vocabulary tokenized: valid ids
    # of other words (the same size: nothing failed)
    "init_from_bert_with_its_own_vocabulary": (
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--model.init_from", "{bert_own_vocab}",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "data vocab_file=None tokenizes with the packaged BERT vocabulary, but model "
         "init_from='{bert_own_vocab}' has its own vocab.txt (30522 pieces, other than the packaged ones); set "
         "data.vocab_file='{bert_own_vocab}/vocab.txt'"], []),
    # the same for a classifier fine-tune (labelled rows; the built-in docstring task): not checked, trained
    "finetune_init_from_bert_with_its_own_vocabulary": (
        [*FINETUNE, "--data.init_args.train", "{train}", "--model.init_from", "{bert_own_vocab}",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "data vocab_file=None tokenizes with the packaged BERT vocabulary, but model "
         "init_from='{bert_own_vocab}' has its own vocab.txt (30522 pieces, other than the packaged ones); set "
         "data.vocab_file='{bert_own_vocab}/vocab.txt'"], []),
    "docstring_task_init_from_bert_with_its_own_tokenizer_json": (
        ["finetune", "fit", "--config", str(ROOT / "recipes" / "bert_tiny_finetune.yaml"), "--model.init_from",
         "{bert_own_tokenizer}", "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "has its own tokenizer.json (30522 pieces, other than the packaged ones); set "
         "data.vocab_file='{bert_own_tokenizer}/tokenizer.json'"], []),
    "init_from_bert_with_its_own_tokenizer_json": (
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--model.init_from", "{bert_own_tokenizer}",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "has its own tokenizer.json (30522 pieces, other than the packaged ones); set "
         "data.vocab_file='{bert_own_tokenizer}/tokenizer.json'"], []),
    # a decoder folder whose tokenizer.json is not the packaged BPE the built-in corpus is tokenized with (its pieces
    # permuted): its tokenizer was never read, the run trained on ids that are other pieces to the model
    "init_from_decoder_with_its_own_tokenizer": (
        ["fit", "--config", GPT, "--model.init_args.init_from", "{llama_own_tokenizer}",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["2 configuration problem(s)", "data vocab_file=None tokenizes with the packaged BPE, but model init_from="
         "'{llama_own_tokenizer}' has its own tokenizer.json (8192 pieces, other than the packaged ones); set "
         "data.vocab_file='{llama_own_tokenizer}/tokenizer.json'"], []),
    # data that records its tokenizer, a source of a smaller vocabulary: data.vocab_file cannot change the ids written
    "init_from_a_smaller_vocabulary_than_the_datasets": (
        ["fit", "--config", GPT, "--model.init_args.init_from", "{llama97}", "--data.init_args.data_prefix", "{gpt}",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["model vocab_size=97 (init_from='{llama97}') is smaller than the data's tokenizer (", "the one the data "
         "records, 8192 pieces): the data would hold ids the model has no embedding for; preprocess the data with "
         "the source's tokenizer (`lightning-megatron preprocess --input YOUR_TEXT --tokenizer {llama97} "
         "--append-eod --output-prefix NEW_PREFIX`, then data.data_prefix=NEW_PREFIX)"], ["data.vocab_file="]),
    # data made with --add-special-tokens, read with a vocab_file that adds none: it named preprocess's flag
    "a_vocab_file_without_the_datas_bos": (
        ["fit", "--config", GPT, "--data.init_args.data_prefix", "{with_bos}", "--data.init_args.vocab_file",
         "{llama_own_tokenizer}/tokenizer.json", "--trainer.strategy.init_args.timeout", "0"], None,
        ["dataset '{with_bos}' was preprocessed with --add-special-tokens by '{llama_bos}/tokenizer.json', but data "
         "vocab_file='{llama_own_tokenizer}/tokenizer.json' adds no special tokens to a text; leave data.vocab_file "
         "unset (the tokenizer the data records) or preprocess the data with the one you name"],
        ["drop --add-special-tokens"]),
    # the callback set accumulate_grad_batches after the strategy's check: each step kept its last batch's gradient
    "gradient_accumulation_scheduler": (
        [*FIT, "--trainer.callbacks+=lightning.pytorch.callbacks.GradientAccumulationScheduler",
         "--trainer.callbacks.scheduling", "{{0: 2}}", "--trainer.strategy.init_args.timeout", "0"], None,
        ["callback GradientAccumulationScheduler is not supported by MegatronStrategy: it accumulates by setting "
         "accumulate_grad_batches"], []),
    "learning_rate_finder": (  # ran its sweep, then trained at the schedule's lr: "not enough points"
        [*FIT, "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateFinder",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["callback LearningRateFinder is not supported by MegatronStrategy: the lr_schedule section sets the lr"], []),
    # Lightning's own tracebacks with the recipes' settings: said before launch with the fix
    "fraction_of_an_epoch_validation": (
        [*FIT, "--trainer.val_check_interval", "0.5", "--trainer.strategy.init_args.timeout", "0"], None,
        ["val_check_interval=0.5 is a fraction of an epoch, but check_val_every_n_epoch=None validates every "
         "val_check_interval steps"], []),
    "barebones": ([*FIT, "--trainer.barebones", "true", "--trainer.strategy.init_args.timeout", "0"], None,
                  ["barebones=True turns off the logger, progress bar, model summary and checkpoints"], []),
    "lightnings_distributed_sampler": (
        [*FIT, "--trainer.use_distributed_sampler", "true", "--trainer.strategy.init_args.timeout", "0"], None,
        ["use_distributed_sampler=True: GPTDataModule gives each data-parallel rank its share itself"], []),
    "precision_64": ([*FIT, "--trainer.precision", "64", "--trainer.strategy.init_args.timeout", "0"], None,
                     ["precision=64 is not supported by MegatronStrategy; use one of ['16-true', '32-true', "
                      "'bf16-mixed', 'bf16-true']"], []),
    # the compiled layer's recomputed attention drew other dropout masks than its forward: not the loss's gradients
    "compile_with_selective_recomputation_and_dropout": (
        [*FIT, "--model.init_args.compile", "true", "--model.init_args.config.recompute_granularity", "selective",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["model.compile=True with recompute_granularity='selective' and attention_dropout=0.1"], []),
    "predict_compiled_with_selective_recomputation": (  # no backward: not refused (the timeout alone)
        [*PREDICT, "--model.init_args.compile", "true", "--model.init_args.config.recompute_granularity",
         "selective", "--trainer.strategy.init_args.timeout", "0"], None, ["2 configuration problem(s)",
                                                                            "predict without --ckpt_path"],
        ["compile=True"]),
    "weight_decay_increment_without_a_horizon": (  # a traceback on the ranks after launch
        [*FIT, "--trainer.max_steps", "-1", "--trainer.max_epochs", "2", "--lr_schedule.lr_decay_steps", "10",
         "--lr_schedule.wd_incr_style", "linear", "--lr_schedule.end_wd", "0.2", "--lr_schedule.lr_warmup_steps",
         "20", "--trainer.strategy.init_args.timeout", "0"], None,
        ["wd_incr_steps=null means trainer.max_steps, but max_steps=-1; set trainer.max_steps or "
         "lr_schedule.wd_incr_steps", "lr_warmup_steps=20 must be < lr_decay_steps=10"], []),
    "init_from_bert_with_the_packaged_vocabulary": (
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--model.init_from", "{bert}",
         "--trainer.strategy.init_args.timeout", "0"], None, ["1 configuration problem(s)", "strategy timeout=0"], []),
    # settings no part of the model reads, trained without a word (the audit of silently ignored settings)
    "bert_with_experts": (  # a dense BERT with MoE metric columns, all zero; EP=2 held the whole model on each rank
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--model.config.num_moe_experts", "8",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["num_moe_experts=8 but spec='bert_layer_local_spec' has a dense MLP; use a spec of your own (register_spec) "
         "whose MLP slot is transformer.moe.MoELayer"], []),
    "bert_with_rotary_settings": (
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--model.config.rotary_base", "500000",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["rotary_base=500000.0 would not be used: BERT's positions are learned (max_sequence_length rows), it has no "
         "rotary embedding: drop them"], []),
    "rotary_settings_on_learned_positions": (
        [*FIT, "--model.init_args.config.rotary_base", "500000", "--model.init_args.config.rotary_percent", "0.5",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["rotary_base=500000.0, rotary_percent=0.5 would not be used: position_embedding_type='learned_absolute' has "
         "no rotary embedding: set position_embedding_type: rope, or drop them"], []),
    "expert_settings_on_a_dense_decoder": (
        [*FIT, "--model.init_args.config.moe_router_topk", "1", "--model.init_args.config.moe_aux_loss_coeff", "0.5",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["moe_router_topk=1, moe_aux_loss_coeff=0.5 would not be used: num_moe_experts is not set, so the model has "
         "no experts"], []),
    "bert_binary_head_without_pairs": (  # the head trained on a constant label 0
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--data.binary_head", "null",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["data binary_head=None builds samples without sentence pairs (binary label 0), and the model's "
         "add_binary_head=True would train its pooler and binary head on that constant label: set "
         "--model.config.add_binary_head false --model.config.num_tokentypes 0"], []),
    "bert_pairs_without_binary_head": (  # half the samples' sentences swapped, the labels read by nothing
        ["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--model.config.add_binary_head", "false",
         "--trainer.strategy.init_args.timeout", "0"], None,
        ["data binary_head='sop' builds sentence pairs for a binary head (half of them swapped or replaced), and the "
         "model has none (add_binary_head=False): set --data.binary_head null"], []),
    # a mistyped option: argparse's error and a close match, not ~100 lines of usage
    "abbreviated_option": ([*FIT, "--trainer.max_step", "50"], 2,
                           ["unrecognized arguments: --trainer.max_step 50", "did you mean --trainer.max_steps or",
                            "(lightning-megatron fit --help lists every option)"], ["usage:"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_launch_naming_the_value(case, inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])  # as the console script, with argv passed in
    argv, code, wanted, unwanted = CASES[case]
    argv = [a.format(**inputs) for a in argv]
    run = tmp_path / "run"
    if argv[0] != "check" and "--trainer.default_root_dir" not in argv:
        argv += ["--trainer.default_root_dir", str(run)]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    if code is None:  # the CLI's ConfigError: one message, every problem on a line of its own
        message = str(exited.value.code)
        assert message.startswith("lightning-megatron: ") and BEFORE_LAUNCH in message, message
    else:  # argparse's error (exit 2) on stderr
        message = capsys.readouterr().err
        assert exited.value.code == code, (exited.value.code, message)
    for text in wanted:
        assert text.format(**inputs) in message, message
    for text in unwanted:
        assert text not in message, message
    assert not dist.is_initialized() and not run.exists()  # nothing launched, nothing written
    # and no local rank started early outlives the refusal (it would import for seconds, for nothing)
    assert not [p for p in psutil.Process().children() if "lightning_megatron.launch" in " ".join(p.cmdline())]


def test_data_without_the_bos_the_sources_tokenizer_puts_first_is_said_before_launch(inputs, tmp_path, monkeypatch):
    """A Llama 3 folder's tokenizer puts a BOS before every text; its corpus preprocessed without
    --add-special-tokens (the default, Megatron's) continues training on documents unlike the source's: said
    once before launch, naming the flag; not said for data made with it."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    said = {}
    blend = f"[0.5, {inputs['with_bos']}, 0.5, {inputs['no_bos']}]"  # the first dataset's tokenizer adds the BOS
    for data, prefix in (("no_bos", inputs["no_bos"]), ("with_bos", inputs["with_bos"]), ("blend", blend)):
        argv = ["fit", "--config", GPT, "--model.init_args.init_from", inputs["llama_bos"],
                "--data.init_args.data_prefix", prefix, "--trainer.strategy.init_args.timeout", "0",
                "--trainer.default_root_dir", str(tmp_path / data)]
        with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exited:
            warnings.simplefilter("always")
            main(argv)
        assert "1 configuration problem(s)" in str(exited.value.code), exited.value.code  # the timeout alone
        said[data] = [str(w.message) for w in caught if "BOS" in str(w.message)]
    assert said["with_bos"] == []
    assert len(said["no_bos"]) == 1 and said["blend"] == said["no_bos"], said
    assert (f"dataset '{inputs['no_bos']}' was preprocessed without --add-special-tokens, but model init_from="
            f"'{inputs['llama_bos']}' has a tokenizer that puts a BOS (id 0, '<|endoftext|>') before every text"
            in said["no_bos"][0]), said["no_bos"][0]
    assert "preprocess the data with --add-special-tokens" in said["no_bos"][0]


def test_a_checkpoint_file_lightning_cannot_parse_is_argparse_s_exit(monkeypatch, tmp_path):
    """The command line's parse errors come back to the CLI (to say them with close matches); the parse
    LightningCLI does after it, of a ``--ckpt_path`` file's hyper-parameters, expects argparse's exit: it
    became a traceback (exit 1)."""
    import torch

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    torch.save({"hyper_parameters": {"no_such_argument": 1}}, tmp_path / "plain.ckpt")
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--ckpt_path", str(tmp_path / "plain.ckpt"),
              "--trainer.default_root_dir", str(tmp_path / "run")])
    assert exited.value.code == 2
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_a_schedule_given_twice_is_refused_before_launch(monkeypatch, tmp_path):
    """A run's ``config.yaml`` saved before 2026-12-07 held the schedule callback in ``trainer.callbacks``; with
    ``--lr_schedule.max_lr`` it got a second one, and Lightning's set-up failed with a traceback (two optimizer
    configs failed every rank's). Refused in one line, saying where the first one is."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(ROOT / "recipes" / "bert_tiny.yaml"), "--trainer.callbacks+=lightning_megatron."
              "callbacks.OptimizerParamSchedulerCallback", "--trainer.default_root_dir", str(tmp_path / "run")])
    assert str(exited.value.code).startswith("lightning-megatron: the lr_schedule section and trainer.callbacks both "
                                             "give the OptimizerParamSchedulerCallback"), exited.value.code
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, subcommand", [(["validate", "--config", GPT], "validate"), (FINETUNE, "fit")],
                         ids=["validate", "finetune-fit"])
def test_a_command_builds_the_parser_of_its_own_subcommand_only(argv, subcommand, inputs, monkeypatch, capsys):
    """LightningCLI builds a parser for each of fit, validate, test and predict, whichever runs: a share of
    every rank's start-up. A command builds its own subcommand's, and parses with it as before (here: a
    mistyped option refused by it, with its usage)."""
    from lightning.pytorch.cli import LightningCLI

    built: list[str] = []
    prepare = LightningCLI._prepare_subcommand_parser

    def recorded(self, klass, name, **kwargs):
        built.append(name)
        return prepare(self, klass, name, **kwargs)

    monkeypatch.setattr(LightningCLI, "_prepare_subcommand_parser", recorded)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    with pytest.raises(SystemExit) as exited:
        main([a.format(**inputs) for a in argv] + ["--trainer.max_step", "5"])
    message = capsys.readouterr().err
    assert exited.value.code == 2 and "unrecognized arguments: --trainer.max_step 5" in message, message
    assert "--trainer.max_step: did you mean --trainer.max_steps or" in message, message
    assert f"(lightning-megatron {'finetune ' if argv[0] == 'finetune' else ''}{subcommand} --help lists" in message
    assert built == [subcommand]


HF_EXTRA = "pip install 'lightning-megatron[hf]'"


@pytest.mark.parametrize("command", ["fit_init_from_hf_folder", "export_hf"])
def test_without_transformers_a_hugging_face_path_names_the_hf_extra(command, inputs, tmp_path, monkeypatch, capsys):
    """transformers is not in the library's install (it is the ``hf`` extra's: torchmetrics, which Lightning
    imports, imports it whenever it is installed, ~0.9 s of every rank's start-up): a command that needs it says
    which install brings it, in one line and before anything is read, launched or written."""
    import lightning.pytorch  # noqa: F401  (imports torchmetrics, which imports transformers when installed)

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises as when not installed
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    folder = tmp_path / "llama_hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    out = tmp_path / "exported"
    if command == "fit_init_from_hf_folder":
        argv = ["fit", "--config", GPT, "--model.init_from", str(folder),
                "--trainer.default_root_dir", str(tmp_path / "run")]
    else:  # the checkpoint does not exist either: the missing package is said first, before anything is read
        argv = ["export", "hf", "--ckpt_path", inputs["nope"], "--output", str(out)]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    message = str(exited.value.code) if command.startswith("fit") else capsys.readouterr().err
    if command.startswith("fit"):
        assert message.startswith(f"lightning-megatron: --model.init_from {folder}: "), message
        assert "reading the Hugging Face folder" in message, message
    else:
        assert exited.value.code == 1 and message.startswith("lightning-megatron export: error: "), message
        assert "exporting a Hugging Face folder" in message, message
    assert f"needs the `transformers` package: {HF_EXTRA}" in message and "Traceback" not in message, message
    assert not dist.is_initialized() and not (tmp_path / "run").exists() and not out.exists()


def _killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer ends a process


def test_a_check_larger_than_this_machine_is_refused_before_launch(monkeypatch, capsys, tmp_path):
    """`check` runs every layout's ranks on this machine's CPU. A GPU recipe checked without ``--gpus``
    (mixtral_8x7b's 46.7B parameters) built the model in the reference's process until the kernel killed it:
    "rank 0 died with exit code -9 without reporting", a traceback. Each layout's ranks together (the memory
    estimate, as `fit` on a CPU is judged) are held against the memory this machine has free, before any process
    starts; a rank killed anyway is named with its signal."""
    from lightning_megatron import machine_checks

    monkeypatch.setattr(machine_checks, "host_memory_available", lambda: 16 * 2**30)
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])

    def refused(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exited:
            main(["check", *argv])
        message = capsys.readouterr().err
        assert exited.value.code == 2 and "found before starting any process" in message, message
        assert "DistributedTestFailure" not in message and "Traceback" not in message, message
        return message

    for recipe, gpus, too_large in (("mixtral_8x7b.yaml", 64, ["tp1", "tp2", "pp2", "dp2"]),
                                    ("llama_1b.yaml", 8, ["dp2"])):
        message = refused(["--config", str(ROOT / "recipes" / recipe), "--estimate-memory"])
        for layout in too_large:
            assert f"  - layout {layout}: on this machine's CPU the " in message, message
        assert "GiB it has free: the kernel would kill a rank; train a smaller shape" in message, message
        assert f"without running anything: --estimate-memory --estimate-time --gpus {gpus} --gpu-memory 80GB" \
            in message, message
    from lightning_megatron.check.cli import main as check_main  # --estimate-time alone runs nothing: not refused

    # a problem of the recipe, not of a layout (a data file missing), is said once, not once a layout
    monkeypatch.chdir(tmp_path)
    message = refused(["--config", str(ROOT / "recipes" / "bert_tiny_sst2.yaml"), "--layouts", "tp2,dp2"])
    assert message.count("labelled data file 'data/sst2/train.jsonl' does not exist") == 1, message
    assert "\n  - labelled data file 'data/sst2/train.jsonl' does not exist" in message, message
    assert "lightning-megatron check: 2 problem(s), found before starting any process" in message, message
    assert check_main(["--config", str(ROOT / "recipes" / "mixtral_8x7b.yaml"), "--estimate-time"]) == 0
    assert "tp2 " in capsys.readouterr().out
    # a vocabulary left to the data's tokenizer is counted too (gpt_tiny's packaged 8,192 pieces)
    monkeypatch.setattr(machine_checks, "host_memory_available", lambda: 64 * 2**20)
    message = refused(["--config", GPT, "--layouts", "tp2"])
    assert "  - layout tp1: on this machine's CPU the 1 rank(s) of tp1 on a host need at least 0.09 GiB" in message
    assert not dist.is_initialized()
    with pytest.raises(DistributedTestFailure, match=r"rank 0 was killed by SIGKILL \(signal 9\) without reporting: "
                                                     r"on Linux most often the out-of-memory killer"):
        run_distributed(_killed, 1, timeout=60)


def test_check_seq_length_sets_the_data_s_own_argument(capsys):
    """``check --seq-length N`` set ``data.max_seq_length`` whatever the data: a decoder recipe's GPTDataModule
    takes ``seq_length``, so its check run died in every rank with "unexpected keyword argument
    'max_seq_length'" (and its estimates kept the recipe's length). It sets the argument the data's class takes:
    the same estimate as ``--data.seq_length N``."""
    from lightning_megatron.check.cli import main as check_main

    estimate = ["--config", GPT, "--estimate-memory", "--estimate-time", "--gpus", "2", "--gpu-memory", "80GB"]
    outputs = []
    for option in (["--seq-length", "64"], ["--data.seq_length", "64"], []):
        assert check_main(estimate + option) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] != outputs[2], outputs
    from lightning_megatron.check.cli import _seq_length_argument

    assert _seq_length_argument("lightning_megatron.datamodules.BertDataModule") == "max_seq_length"
    with pytest.raises(ValueError, match="BoringDataModule takes neither seq_length nor max_seq_length; set its own"):
        _seq_length_argument("lightning.pytorch.demos.boring_classes.BoringDataModule")


LLAMA_1B = str(ROOT / "recipes" / "llama_1b.yaml")


def test_a_run_this_machine_cannot_hold_is_refused_before_launch(monkeypatch, tmp_path):
    """A GPU recipe run where it cannot run: `fit --config recipes/llama_1b.yaml` on a machine without a GPU
    ended in Lightning's traceback ("No supported gpu backend found!"), on one with fewer GPUs than its
    ``trainer.devices`` in another; tried on the CPU (``--trainer.accelerator cpu --trainer.devices 2``), its two
    ranks built 1.1B parameters each until the kernel killed one ("Child process ... terminated with code -9",
    1.5 minutes in). Each is refused before any process starts, naming the value and the fix: a CPU run's ranks
    of a node together (the memory estimate) against the memory this machine has free."""
    import torch

    from lightning_megatron import machine_checks

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    run = ["--trainer.default_root_dir", str(tmp_path / "run")]

    def refused(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exited:
            main(["fit", "--config", LLAMA_1B, *argv, *run])
        message = str(exited.value.code)
        assert message.startswith("lightning-megatron: ") and BEFORE_LAUNCH in message, message
        assert "Traceback" not in message and not dist.is_initialized() and not (tmp_path / "run").exists()
        return message

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # whatever this machine has
    message = refused([])
    assert "trainer.accelerator='gpu': this machine has no such device torch can use (none)" in message, message
    assert "--trainer.accelerator cpu" in message, message
    message = refused(["--trainer.accelerator", "xpu"])
    assert "trainer.accelerator='xpu': this machine has no such device torch can use (none)" in message, message
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("mps"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    message = refused([])
    assert "trainer.devices=8 with trainer.accelerator='gpu': this machine has 1 (mps)" in message, message
    message = refused(["--trainer.accelerator", "xpu", "--trainer.devices", "1"])
    assert "trainer.accelerator='xpu': this machine has no such device torch can use (only mps)" in message, message
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(machine_checks, "host_memory_available", lambda: 16 * 2**30)
    message = refused(["--trainer.accelerator", "cpu", "--trainer.devices", "2"])
    assert "on this machine's CPU the 2 rank(s) of dp2zero1 on a host need at least " in message, message
    assert "more than the 16.00 GiB it has free: the kernel would kill a rank; train a smaller" in message, message


def test_check_takes_a_decoder_recipe_on_its_own_bpe_data(inputs):
    """``check --config gpt_tiny.yaml --data.data_prefix DATA`` on a dataset preprocessed with a byte-level BPE: the
    pre-launch check read the data as a BERT's ("holds a BPE tokenizer; BERT needs WordPiece", each layout), as it
    did not know the recipe's data class; ``fit`` on the same data ran."""
    from lightning_megatron.check.cli import _layout_problems
    from lightning_megatron.check.recipe import load_recipe
    from lightning_megatron.parallel_dims import ParallelDims

    recipe = load_recipe(GPT, data_overrides={"data_prefix": inputs["gpt"]})
    assert _layout_problems(recipe, [ParallelDims.parse("tp1"), ParallelDims.parse("tp2")], runs=False) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fcntl.flock")
def test_a_second_fit_into_a_run_folder_in_use_is_refused_before_launch(inputs, tmp_path, monkeypatch):
    """Two runs started at once into one run folder wrote one ``csv/version_0/metrics.csv`` together (its rows read
    steps 0, 0, 1, 1, ...) and the second's ``hparams.yaml`` replaced the first's; nothing refused the second until
    its first save. The process of global rank 0 holds a lock in the folder while it runs
    (``.lightning-megatron.lock``, released with the process, however it ends); another ``fit`` there is refused
    before launch, naming the holder."""
    import fcntl
    import json as jsonlib

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    run = tmp_path / "run"
    run.mkdir()
    holder = os.open(run / ".lightning-megatron.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first run's process (another open file: it conflicts)
    os.write(holder, jsonlib.dumps({"pid": 4242, "host": "node-a", "started": "2026-12-07 10:00:00",
                                    "command": "lightning-megatron fit --config a.yaml"}).encode())
    argv = [*FIT, "--trainer.default_root_dir", str(run), "--trainer.strategy.init_args.timeout", "0"]
    monkeypatch.setattr("lightning_megatron.config_checks.timeout_problem", lambda timeout: None)  # passes the checks
    with pytest.raises(SystemExit) as exited:
        main(argv)
    message = str(exited.value.code)
    assert message.startswith(f"lightning-megatron: another run is training in {run} now (pid 4242 on node-a, "
                              f"started 2026-12-07 10:00:00: lightning-megatron fit --config a.yaml)"), message
    assert "--trainer.default_root_dir" in message, message
    # once that run has saved, a new fit there is refused for its checkpoints first: the message says the run is live
    # (it said "Resume that run with --ckpt_path last", which the lock then refused)
    (run / "checkpoints" / "step5.ckpt").mkdir(parents=True)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert ("That run is training now (pid 4242 on node-a, started 2026-12-07 10:00:00: lightning-megatron fit "
            "--config a.yaml): once it ends, --ckpt_path last resumes it") in str(exited.value.code), exited.value.code
    shutil.rmtree(run / "checkpoints")
    fcntl.flock(holder, fcntl.LOCK_UN)  # the first run ended: the folder is free (a resume, a new run there)
    os.close(holder)
    monkeypatch.undo()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["lightning-megatron"])
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert "strategy timeout=0" in str(exited.value.code)  # the lock is taken once the checks pass: refused there


def test_sentence_pairs_are_the_training_samples_concern_only():
    """The pairs and the head must agree for what is trained; a BERT without a binary head (Megatron-LM's
    --bert-no-binary-head, imported) predicts and validates under the data section's default binary_head."""
    from lightning_megatron.config_checks import check_config
    from lightning_megatron.datamodules.pretraining import BertDataModule
    from lightning_megatron.models.bert.module import BertLightningModule

    model = {"config": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "add_binary_head": False,
                        "num_tokentypes": 0}}
    for fitting, predicting in ((True, False), (False, True), (False, False)):
        problems = check_config(model, {"predict_file": "texts.txt"} if predicting else {}, data_class=BertDataModule,
                                model_class=BertLightningModule, predicting=predicting, running=False,
                                fitting=fitting)
        assert [p for p in problems if "binary_head" in p] == ([
            "data binary_head='sop' builds sentence pairs for a binary head (half of them swapped or replaced), and "
            "the model has none (add_binary_head=False): set --data.binary_head null, or --model.config.add_binary_head "
            "true"] if fitting else []), (fitting, predicting, problems)
