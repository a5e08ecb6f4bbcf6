"""The data section's checks before launch (:func:`lightning_megatron.config_checks.check_config` calls them): the
files it names (datasets, vocabularies, the prompts of ``predict``, a fine-tuning section's split files), each
dataset's record against the tokenizer the datamodule will use, and the split a command reads whole. They read
vocabularies, sidecars and text files, never the token data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["checkpoint_data_problems", "checkpoint_extra", "data_arguments", "data_files_problems", "int_or_none",
           "tokenizer_family"]


def int_or_none(value: Any) -> int | None:
    """A count from a parsed configuration value (an int, or a string of digits); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _data(error: Exception) -> str:
    """A data problem's line: ``data <message>``, or the message alone when it names its ``data.`` argument."""
    return str(error) if str(error).startswith("data.") else f"data {error}"


def data_arguments(data_class: type | None, d: dict[str, Any]) -> dict[str, Any]:
    """The data section's arguments with the class's defaults under them (the CLI's parsed config has
    them all; a Python caller may give a few)."""
    import inspect

    if data_class is None:
        return dict(d)
    defaults = {k: p.default for k, p in inspect.signature(data_class).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, **d}


def binary_head_problem(d: dict[str, Any], m: dict[str, Any], model_class: type | None, *,
                        python: bool = False) -> str | None:
    """BERT's sentence pairs and its binary head go together (Megatron-LM's one ``--bert-binary-head`` builds both):
    data without pairs (``binary_head=None``) trained the model's head on a constant label 0, and pairs whose labels
    no head reads swapped half the samples' sentences for nothing. ``d``: the data section's arguments with the
    class's defaults (:func:`data_arguments`), ``m``: the model's flat hyper-parameters. ``python``: the fixes
    spelled as the classes' arguments (a fit from Python) instead of the command's flags."""
    import dataclasses

    record = getattr(model_class, "config_class", None)
    fields = {f.name: f.default for f in dataclasses.fields(record)} if dataclasses.is_dataclass(record) else {}
    if "binary_head" not in d or "add_binary_head" not in fields:
        return None
    pairs, head = d["binary_head"], m.get("add_binary_head", fields["add_binary_head"])
    no_head, pairs_on, no_pairs, head_on = (
        ("BertConfig(add_binary_head=False, num_tokentypes=0)", "BertDataModule(binary_head='sop')",
         "BertDataModule(binary_head=None)", "BertConfig(add_binary_head=True)") if python else
        ("--model.config.add_binary_head false --model.config.num_tokentypes 0", "--data.binary_head sop",
         "--data.binary_head null", "--model.config.add_binary_head true"))
    if pairs is None and head:
        return (f"data binary_head=None builds samples without sentence pairs (binary label 0), and the model's "
                f"add_binary_head=True would train its pooler and binary head on that constant label: set {no_head} "
                f"(Megatron-LM's --bert-no-binary-head), or {pairs_on}")
    if pairs is not None and not head:
        return (f"data binary_head={pairs!r} builds sentence pairs for a binary head (half of them swapped or "
                f"replaced), and the model has none (add_binary_head=False): set {no_pairs}, or {head_on}")
    return None


def tokenizer_family(data_class: type | None) -> str:
    """The packaged tokenizer of the data section's datamodule (``default_tokenizer``); WordPiece (BERT's,
    the CLI's default datamodule) when unknown."""
    if data_class is not None:
        from lightning_megatron.datamodules.pretraining import PretrainingDataModule

        if issubclass(data_class, PretrainingDataModule):
            return data_class.default_tokenizer
    return "wordpiece"


def documents_need_eod(data_class: type | None) -> bool:
    """Whether the data section's datamodule joins documents into samples (GPT's), which must then end with an
    end-of-document id, and a sample spans ``seq_length + 1`` tokens of them."""
    from lightning_megatron.datamodules.pretraining import PretrainingDataModule

    return data_class is not None and issubclass(data_class, PretrainingDataModule) and data_class.documents_need_eod


def checkpoint_data_problems(d: dict[str, Any], m: dict[str, Any], *, data_class: type | None,
                             ckpt_path: Any = None) -> list[str]:
    """What the data section's data means otherwise than a checkpoint to load records
    (:func:`~lightning_megatron.checkpoint_data.data_problems`, on the datamodule the ranks will build, so read by its
    own rule): another vocabulary of the same size (valid ids of other text), and for ``ckpt_path`` (a checkpoint
    loaded whole, not ``model.init_from``'s weights for a new head) a classifier's class names in another order.
    The module refuses both again at set-up. A datamodule class without a ``tokenizer`` / ``label_names`` property,
    or one that cannot be built here (the data section's own checks say why), is not judged."""
    import os
    from pathlib import Path

    from lightning_megatron.checkpoint_data import LABEL_NAMES, VOCABULARY, data_problems

    tokenized = data_class is not None and isinstance(getattr(data_class, "tokenizer", None), property)
    labelled = data_class is not None and isinstance(getattr(data_class, "label_names", None), property)
    sources = [(os.fspath(p), extra, whole) for p, whole in ((m.get("init_from"), False), (ckpt_path, True))
               if isinstance(p, (str, os.PathLike)) and (extra := checkpoint_extra(Path(p))) is not None]
    sources = [(path, extra, whole) for path, extra, whole in sources
               if (tokenized and isinstance(extra.get(VOCABULARY), dict))
               or (labelled and whole and extra.get(LABEL_NAMES) is not None)]
    if not sources or data_class is None:
        return []
    try:  # the datamodule the ranks will build: its own tokenizer and class names (one rule)
        datamodule = data_class(**data_arguments(data_class, d))
        return [problem for path, extra, whole in sources for problem in data_problems(extra, datamodule, path,
                                                                                         labels=whole)]
    except Exception:  # noqa: BLE001 - the data section's own checks name what is wrong with it
        return []


def checkpoint_extra(path: Any) -> dict[str, Any] | None:
    """Our checkpoint directory's ``extra.pt``, its checksum matched
    (:func:`~lightning_megatron.checkpoint.saved_extra`); None for anything else, and for a checkpoint that does not
    verify (the ranks' verification names why)."""
    from lightning_megatron.checkpoint import CheckpointError, saved_extra

    try:
        saved = saved_extra(path)
    except CheckpointError:
        return None
    return saved[0] if saved is not None else None


def _preprocess_with(source: Any, data_class: type | None) -> str:
    """The ``preprocess`` command line that tokenizes a corpus with ``source``'s tokenizer for ``data_class``."""
    import os

    eod = " --append-eod" if documents_need_eod(data_class) else ""
    return (f"`lightning-megatron preprocess --input YOUR_TEXT --tokenizer {os.fspath(source)}{eod} --output-prefix "
            f"NEW_PREFIX`, then data.data_prefix=NEW_PREFIX")


def _source_tokenizer_problem(tokenizer: Any, vocab_file: Any, m: dict[str, Any], data_class: type | None,
                              recorded: bool = False) -> str | None:
    """A source folder (``init_from``: a Hugging Face folder) with a tokenizer of its own (``vocab.txt``,
    ``tokenizer.json``) other than the data's ``tokenizer`` (the packaged vocabulary, a ``vocab_file``, the one a
    dataset records: ``recorded``): valid ids of other pieces, a model of the same size failing nowhere (a decoder's
    folder was never read: its tokenizer permuted, or malformed, trained without a word)."""
    import os
    from pathlib import Path

    from lightning_megatron.data.dataset_vocab import dataset_tokenizer, pieces_sha256
    from lightning_megatron.datamodules.finetune import FinetuneDataModule
    from lightning_megatron.datamodules.pretraining import PretrainingDataModule

    source = m.get("init_from")
    if not isinstance(source, (str, os.PathLike)) or data_class is None or not issubclass(
            data_class, (PretrainingDataModule, FinetuneDataModule)) or not Path(source).is_dir():
        return None
    names = ("tokenizer.json", "vocab.txt", "vocab.json")
    own = next((Path(source) / n for n in names if (Path(source) / n).is_file()), None)
    if own is None:
        return None  # no tokenizer of its own (one of our checkpoints records its vocabulary: checked at set-up)
    try:
        theirs = dataset_tokenizer(os.fspath(own), None, default=tokenizer_family(data_class))
    except (ValueError, OSError) as error:
        return f"model init_from={os.fspath(source)!r}: its {own.name} cannot be read as the data's kind: {error}"
    if pieces_sha256(theirs.inv_vocab) == pieces_sha256(tokenizer.inv_vocab):
        return None
    if vocab_file is None and not recorded:
        data = "data vocab_file=None tokenizes with the packaged " + (
            "BPE" if tokenizer_family(data_class) == "bpe" else "BERT vocabulary")
        other = "other than the packaged ones"
    else:
        data = (f"data vocab_file={os.fspath(vocab_file)!r} tokenizes" if vocab_file is not None
                else f"the data was tokenized with {os.fspath(tokenizer.vocab_file)!r}")
        other = "other than the data's"
    fix = f"set data.vocab_file={str(own)!r}" if not recorded else (
        f"preprocess the data with it ({_preprocess_with(source, data_class)})")
    return (f"{data}, but model init_from={os.fspath(source)!r} has its own {own.name} ({theirs.vocab_size} "
            f"pieces, {other}); {fix}")


def data_files_problems(d: dict[str, Any], m: dict[str, Any], *, data_class: type | None = None,
                      predicting: bool = False, running: bool = True, split: str | None = None) -> list[str]:
    """The files the data section names: each ``data_prefix`` (or blend member) has its ``.bin`` and
    ``.idx``, the ``vocab_file`` exists, and a dataset's ``.vocab.json`` (written by ``preprocess``)
    records the vocabulary of the tokenizer the datamodule will use (``vocab_file``, else the one the
    record names, else the packaged one: :func:`~lightning_megatron.data.dataset_vocab.dataset_tokenizer`,
    the datamodule's own rule) and ids below the model's ``vocab_size``. ``predicting``: the
    ``predict_file`` is read and a decoder's longest prompt plus ``predict_max_new_tokens`` must fit the
    model's positions; a chat section's (SFTDataModule's) split files are read (``read_splits``: JSON, nothing
    tokenized). A fine-tuning section (LabelledTextDataModule's arguments: ``text_key``,
    ``label_key`` and split files): its files are read, when predicting only the input of ``predict``
    (:func:`~lightning_megatron.data.labelled_text.labelled_files_problems`). Reads only the vocabulary,
    the small sidecar and these text files, never the token data; the datamodule checks the same again
    at set-up (lightning_megatron.data.dataset_vocab)."""
    import os

    vocab_file, data_prefix = d.get("vocab_file"), d.get("data_prefix")
    problems: list[str] = []
    vocab_missing = vocab_file is not None and not os.path.exists(os.fspath(vocab_file))
    if vocab_missing:
        problems.append(f"data vocab_file={os.fspath(vocab_file)!r} does not exist; pass the vocab.txt the dataset "
                        f"was preprocessed with (or null for the packaged BERT vocabulary)")
    arguments = data_arguments(data_class, d)
    source = m.get("init_from")
    if {"chat_template", "tokenizer"} <= arguments.keys() and arguments.get("tokenizer") is None and isinstance(
            source, (str, os.PathLike)) and os.path.isfile(os.path.join(os.fspath(source), "tokenizer.json")):
        # chats encoded with the packaged BPE for a model that came with its own tokenizer: valid ids, wrong text
        problems.append(f"data tokenizer=None encodes the chats with the packaged BPE, but model init_from="
                        f"{os.fspath(source)!r} has its own tokenizer.json; set data.tokenizer={os.fspath(source)!r}")
    if {"chat_template", "tokenizer"} <= arguments.keys():  # chats (SFTDataModule): its own prompt reader
        if predicting and arguments.get("predict_file") is not None and data_class is not None:
            problems += _check_prompts(arguments, m, lambda: data_class(**arguments).read_prompts())
        elif running and not predicting and data_class is not None and hasattr(data_class, "read_splits"):
            # the chat files, read as every rank's set-up reads them (JSON only, nothing tokenized): a missing
            # file, a chat without an answer, a split left empty; the datamodule's own argument checks too
            try:
                splits = data_class(**arguments).read_splits()
            except (OSError, ValueError) as error:
                problems.append(_data(error))
            else:
                batch = arguments.get("global_batch_size")
                chats = len(splits.get("train", ()))
                if split is None and isinstance(batch, int) and chats < batch:  # fit: a chat is at most a sample
                    problems.append(f"data: the train split has {chats} chats and global_batch_size={batch}: a "
                                    f"training step needs a full global batch and a chat makes at most one sample; "
                                    f"lower data.global_batch_size or give more chats")
        return problems
    if running and not vocab_missing:  # a classifier's rows, tokenized for the model init_from names
        problems += _finetune_source_problems(vocab_file, arguments, m, data_class)
    if {"text_key", "label_key"} <= arguments.keys():
        # labelled split files (LabelledTextDataModule's arguments), read only when a command runs; predict
        # reads only its input (the predict_file, or the split it predicts)
        from lightning_megatron.data.labelled_text import labelled_files_problems

        found = labelled_files_problems(arguments, predicting=predicting) if running else []
        batch = arguments.get("global_batch_size")
        if (running and not predicting and split is None and not found and arguments.get("dataset") is None
                and data_class is not None and hasattr(data_class, "read_splits") and isinstance(batch, int)):
            # fit: the training rows (after the held-out fractions) make at least one global batch, as the
            # datamodule requires once every rank has started
            try:
                rows = len(data_class(**arguments).read_splits()["train"])
            except (OSError, ValueError) as error:
                found.append(_data(error))
            else:
                if rows < batch:
                    found.append(f"data: the train split has {rows} rows and global_batch_size={batch}: a training "
                                 f"step needs a full global batch; lower data.global_batch_size")
        return problems + found
    prefixes: list[str] = []
    found: list[str] = []
    if data_prefix is None and not vocab_missing and running:
        problems += _built_in_corpus_problems(vocab_file, m, data_class)
    blends: list[Any] = []
    if data_prefix is not None:  # None: the built-in corpus, preprocessed with the right vocabulary at set-up
        from lightning_megatron.data.blended import split_blends

        try:
            blends = split_blends(data_prefix)  # a prefix or blend for every split, or one of them per split
        except (TypeError, ValueError) as error:
            return [*problems, _data(error)]
        prefixes = list(dict.fromkeys(p for blend in blends if blend is not None for p in blend[1]))  # train's first
        for prefix in prefixes:
            missing = [f"{prefix}{ext}" for ext in (".bin", ".idx") if not os.path.isfile(f"{prefix}{ext}")]
            if not missing:
                found.append(prefix)
                continue
            stem, ext = os.path.splitext(prefix)
            hint = (f"the prefix is the path without {ext}: data_prefix={stem!r}" if ext in (".bin", ".idx")
                    else f"make it with `lightning-megatron preprocess --input ... --output-prefix {prefix}`")
            problems.append(f"data data_prefix={prefix!r}: {' and '.join(repr(x) for x in missing)} not found "
                            f"(relative paths start at {os.getcwd()!r}); {hint}")
        if not found:
            return problems
    if vocab_missing:
        return problems
    from lightning_megatron.data.dataset_vocab import check_dataset_vocab, dataset_tokenizer, read_dataset_vocab

    tokenizer: Any = None

    def data_tokenizer() -> Any:  # the datamodule's: the first dataset's record names its vocabulary
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = dataset_tokenizer(vocab_file, prefixes[0] if prefixes else None,
                                          default=tokenizer_family(data_class))
        return tokenizer

    model_vocab = int_or_none(m.get("vocab_size"))
    for prefix in found:
        try:
            if read_dataset_vocab(prefix) is None:
                continue  # no record: the datamodule warns at set-up
            check_dataset_vocab(prefix, data_tokenizer(), model_vocab, needs_eod=documents_need_eod(data_class))
        except (ValueError, OSError) as error:
            problems.append(_data(error))
            if tokenizer is None:
                return problems  # the tokenizer itself cannot be had: said once
    if tokenizer is not None:  # the datasets' tokenizer: a model vocabulary smaller than it (BERT's masking draws
        # replacement ids from the whole tokenizer, past the largest id the data holds)
        problems += [p for p in [_model_vocab_problem(tokenizer, vocab_file, m, data_class, recorded=True),
                                 _source_tokenizer_problem(tokenizer, vocab_file, m, data_class, recorded=True)] if p]
        if not problems:
            _warn_missing_bos(m, found)
    sample_tokens = _sample_tokens(data_class, arguments)
    problems += [p for p in (_too_short_problem(prefix, sample_tokens) for prefix in found) if p]
    if split is not None and found and running and not (predicting and d.get("predict_file") is not None):
        if isinstance(data_prefix, Mapping):  # each split's data whole: the split the command reads must be named
            i = ("train", "valid", "test").index(split)
            mine = [p for p in (blends[i][1] if blends[i] is not None else []) if p in found]
            command = "predict" if predicting else {"valid": "validate", "test": "test"}[split]
            problem = (_empty_split_problem(mine, ",".join("1" if j == i else "0" for j in range(3)), split,
                                            predicting, sample_tokens, what=f"data data_prefix.{split}") if mine else
                       f"data data_prefix names no {split} dataset ({', '.join(data_prefix)}): `{command}` would have "
                       f"nothing to read; add data_prefix.{split}" + (" or pass --data.predict_file" if predicting
                                                                      else ""))
            problems += [problem] if problem else []
        else:
            problems += [p for p in [_empty_split_problem(found, str(arguments.get("splits", "949,50,1")), split,
                                                          predicting, sample_tokens)] if p]
    if predicting and d.get("predict_file") is not None:
        from lightning_megatron.data.predict import PromptDataset

        key = arguments.get("predict_json_key", "text")
        problems += _check_prompts(arguments, m, lambda: PromptDataset(
            os.fspath(arguments["predict_file"]), data_tokenizer(), key,
            max_length=int_or_none(arguments.get("seq_length"))))
    return problems


def _finetune_source_problems(vocab_file: Any, arguments: dict[str, Any], m: dict[str, Any],
                              data_class: type | None) -> list[str]:
    """A classifier fine-tune (a :class:`~lightning_megatron.datamodules.finetune.FinetuneDataModule`) tokenizes
    its rows with ``vocab_file`` (else the packaged WordPiece vocabulary): an ``init_from`` folder with a tokenizer
    of its own is checked as pretraining's (:func:`_source_tokenizer_problem`)."""
    from lightning_megatron.datamodules.finetune import FinetuneDataModule

    if data_class is None or not issubclass(data_class, FinetuneDataModule) or m.get("init_from") is None:
        return []
    from lightning_megatron.data.tokenizer import BertTokenizer

    try:
        tokenizer = BertTokenizer(vocab_file, lowercase=arguments.get("lowercase"))
    except (ValueError, OSError) as error:
        return [_data(error)]
    return [p for p in [_source_tokenizer_problem(tokenizer, vocab_file, m, data_class)] if p]


def _built_in_corpus_problems(vocab_file: Any, m: dict[str, Any], data_class: type | None) -> list[str]:
    """The built-in corpus is tokenized at set-up with the data's tokenizer (``vocab_file``, else the packaged one):
    one that cannot be built (a WordPiece vocabulary without ``[MASK]``) failed every rank after launch, and a model
    vocabulary smaller than it (:func:`_model_vocab_problem`)."""
    from lightning_megatron.data.dataset_vocab import dataset_tokenizer

    from lightning_megatron.datamodules.pretraining import PretrainingDataModule

    if data_class is None or not issubclass(data_class, PretrainingDataModule):
        return []  # a datamodule of one's own: its data is its business
    try:
        tokenizer = dataset_tokenizer(vocab_file, None, default=tokenizer_family(data_class))
    except (ValueError, OSError) as error:
        return [_data(error)]
    return [p for p in [_model_vocab_problem(tokenizer, vocab_file, m, data_class),
                        _source_tokenizer_problem(tokenizer, vocab_file, m, data_class)] if p]


def _warn_missing_bos(m: dict[str, Any], prefixes: list[str]) -> None:
    """Warn (once, rank 0) where datasets preprocessed without ``--add-special-tokens`` continue training a Hugging
    Face folder (``init_from``) whose own ``tokenizer.json`` puts a BOS before every text (Llama 3's): the model sees
    documents unlike its pretraining's. Each dataset by its own record (a blend may mix them); Megatron's default,
    so said, not refused."""
    import os
    from pathlib import Path

    from lightning.pytorch.utilities import rank_zero_warn

    from lightning_megatron.data.bpe_tokenizer import BPETokenizer
    from lightning_megatron.data.dataset_vocab import read_dataset_vocab
    from lightning_megatron.interop.sources import source_kind

    source = m.get("init_from")
    if not isinstance(source, (str, os.PathLike)) or source_kind(source) != "hf":
        return
    own = Path(source) / "tokenizer.json"
    try:
        theirs = BPETokenizer(own) if own.is_file() else None
        first = theirs.added_tokens()[0] if theirs is not None else []
    except (ValueError, OSError):
        return  # not a BPE tokenizer: a WordPiece vocabulary's [CLS] is BERT's data's own
    plain = [p for p in prefixes if (r := read_dataset_vocab(p)) is not None and r.tokenizer_type == "bpe"
             and not r.add_special_tokens]
    if first and plain:
        bos = ", ".join(f"id {i}, {theirs.inv_vocab[i]!r}" for i in first)
        rank_zero_warn(f"dataset {plain[0]!r} was preprocessed without --add-special-tokens, but model init_from="
                       f"{os.fspath(source)!r} has a tokenizer that puts a BOS ({bos}) before every text: the model "
                       f"continues training on documents unlike its pretraining's; preprocess the data with "
                       f"--add-special-tokens (docs/data.md)")


def _model_vocab_problem(tokenizer: Any, vocab_file: Any, m: dict[str, Any], data_class: type | None,
                         recorded: bool = False) -> str | None:
    """A model ``vocab_size`` smaller than the data's tokenizer (an ``init_from`` source's, or one set by hand): the
    data would hold ids the model has no embedding for (BERT's masking draws replacements from the whole
    tokenizer: into padded rows at TP > 1, unsaid), and no export could name its vocabulary."""
    import os

    from lightning_megatron.datamodules.pretraining import PretrainingDataModule

    model_vocab = int_or_none(m.get("vocab_size"))
    if model_vocab is None or data_class is None or not issubclass(data_class, PretrainingDataModule):
        return None  # a datamodule of one's own: its data is its business
    if tokenizer.vocab_size <= model_vocab:
        return None
    which = "the packaged BPE" if vocab_file is None and tokenizer_family(data_class) == "bpe" else \
        "the packaged WordPiece vocabulary" if vocab_file is None else f"vocab_file={os.fspath(vocab_file)!r}"
    if recorded and vocab_file is None and getattr(tokenizer, "vocab_file", None) is not None:
        which = f"{os.fspath(tokenizer.vocab_file)!r}, the one the data records"
    source = m.get("init_from")
    named = f" (init_from={os.fspath(source)!r})" if source is not None else ""
    fix = ("set model vocab_size to it, or leave it null" if source is None else
           f"preprocess the data with the source's tokenizer ({_preprocess_with(source, data_class)})" if recorded
           else  # data.vocab_file would not change the ids written
           f"tokenize the data with the source's tokenizer: data.vocab_file={os.fspath(source)!r} (its "
           f"tokenizer.json or vocab.txt)")
    return (f"model vocab_size={model_vocab}{named} is smaller than the data's tokenizer ({which}, "
            f"{tokenizer.vocab_size} pieces): the data would hold ids the model has no embedding for; {fix}")


def _too_short_problem(prefix: str, sample_tokens: int | None) -> str | None:
    """A dataset holding fewer tokens in all than one sample spans (``sample_tokens``, where samples join documents;
    from the ``.idx`` header and the ``.bin`` size, constant time): no split of it has a sample, which the ranks
    would find after launch."""
    from lightning_megatron.data.indexed_dataset import dataset_counts

    counts = dataset_counts(prefix) if sample_tokens is not None else None
    if counts is None or counts[1] >= sample_tokens:
        return None
    return (f"data seq_length={sample_tokens - 1}: dataset {prefix!r} holds {counts[1]} tokens in all, fewer than "
            f"one sample's seq_length + 1 = {sample_tokens}; use more text or a shorter seq_length")


def _sample_tokens(data_class: type | None, arguments: dict[str, Any]) -> int | None:
    """The tokens one sample of the data section's datamodule spans, where samples join documents (GPT's
    ``seq_length + 1``, :func:`documents_need_eod`); None otherwise."""
    seq_length = arguments.get("seq_length")
    return seq_length + 1 if documents_need_eod(data_class) and isinstance(seq_length, int) else None


def _empty_split_problem(prefixes: list[str], splits: str, split: str, predicting: bool,
                         sample_tokens: int | None = None, what: str | None = None) -> str | None:
    """The ``split`` a command reads whole holding no document of any dataset of ``prefixes`` (Megatron's split of
    each by ``splits``, as the datamodule cuts it): the command would read nothing (a split of weight 0 too).
    ``sample_tokens``: where samples join documents (GPT), a split of fewer tokens than one sample holds none.
    ``what``: how the message names the cut (default ``data splits=...``)."""
    from lightning_megatron.data.bert_dataset import get_train_valid_test_split_
    from lightning_megatron.data.gpt_dataset import document_lengths
    from lightning_megatron.data.indexed_dataset import IndexedDataset

    i = ("train", "valid", "test").index(split)
    try:
        datasets = [IndexedDataset(p) for p in prefixes]
        counts = [d.num_documents for d in datasets]
        bounds = [get_train_valid_test_split_(splits, n) for n in counts]
    except (ValueError, OSError):
        return None  # said by the checks of the files and the datamodule's arguments
    n, command = sum(counts), "predict" if predicting else {"valid": "validate", "test": "test"}[split]
    fix = (f"`{command}` would have nothing to read; give it more documents or a larger weight"
           + (", or pass --data.predict_file" if predicting else ""))
    if not any(b[i + 1] > b[i] for b in bounds):
        return (f"{what or f'data splits={splits!r}'} gives the {split} split none of the {n} "
                f"document{'s' if n != 1 else ''} "
                f"of {', '.join(prefixes)}: {fix}")
    if sample_tokens is None:
        return None
    tokens = [int(document_lengths(d)[b[i]:b[i + 1]].sum()) for d, b in zip(datasets, bounds)]
    if max(tokens) >= sample_tokens:
        return None
    docs = sum(b[i + 1] - b[i] for b in bounds)
    return (f"{what or f'data splits={splits!r}'} gives the {split} split {docs} of the {n} documents of "
            f"{', '.join(prefixes)}, "
            f"holding {sum(tokens)} tokens: fewer than one sample's seq_length + 1 = {sample_tokens}; {fix}")


def _check_prompts(d: dict[str, Any], m: dict[str, Any], read_prompts: Any) -> list[str]:
    """``predict``'s ``predict_file``: readable (UTF-8, JSON lines with ``predict_json_key``; chats for an
    ``SFTDataModule``); a decoder's prompts (``read_prompts()``: tokenized as the datamodule will, with their
    ``lengths`` and ``lines``) each fit
    ``seq_length``, and the longest one plus ``predict_max_new_tokens`` fits the model's positions (a trained
    model's positions are fixed: the fix is fewer new tokens or shorter prompts)."""
    import os

    from lightning_megatron.data.predict import read_texts

    path, key = os.fspath(d["predict_file"]), d.get("predict_json_key", "text")
    new, positions = int_or_none(m.get("predict_max_new_tokens")), int_or_none(m.get("max_sequence_length"))
    try:
        if new is None:  # an encoder's texts (cut to max_seq_length by the datamodule)
            read_texts(path, key)
            return []
        prompts = read_prompts()
        lengths, lines = prompts.lengths, prompts.lines
    except (ValueError, OSError) as error:
        return [_data(error)]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    need = lengths[longest] + new - 1  # the last new token is written, never fed back
    if positions is None or need <= positions:
        return []
    fewer = positions - lengths[longest] + 1
    fix = (f"generate at most {fewer} new tokens (--model.predict_max_new_tokens {fewer}) or shorten the prompts "
           f"to at most {max(positions - new + 1, 1)} tokens" if fewer >= 1 else "shorten the prompt")
    return [f"--model.predict_max_new_tokens={new}: the longest prompt of predict_file {path!r} (line "
            f"{lines[longest]}, {lengths[longest]} tokens) followed by {new} new tokens needs {need} positions, more "
            f"than the model's max_sequence_length={positions}; {fix}"]
