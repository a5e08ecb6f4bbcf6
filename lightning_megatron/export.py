"""``lightning-megatron export hf``: a checkpoint of ours (any layout) -> a Hugging Face folder, through the
state-dict adapter of the module class that wrote it.

Which class wrote the checkpoint (:func:`module_class_of`), in this order:

1. ``--model-class package.module.Class`` (``model_class=``), when given; a checkpoint that records
   another class refuses it;
2. the class the checkpoint records (``module_class`` in ``extra.pt``, written by every
   ``MegatronLightningModule`` since interop moved to adapters);
3. LightningCLI's own record, ``_class_path`` in the saved hyper-parameters (a run whose recipe or
   command line named ``model: class_path``);
4. none of them (a checkpoint written before the record, by ``lightning-megatron fit`` without a class
   path or by Python): :data:`DEFAULT_MODEL_CLASS`, the class the CLI builds when no class path is
   named. If its adapter cannot export the checkpoint, the error says how it was chosen and to pass
   ``--model-class``.

Tensor names never choose the class. A recorded class outside ``lightning_megatron`` is imported only
when ``--model-class`` names it too (nothing a checkpoint says makes us import a package of its choice);
the class must be a ``MegatronLightningModule`` declaring an ``interop`` adapter.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Any

from lightning_megatron.interop import check_adapter
from lightning_megatron.interop.hf_folder import check_output_folder, hf_model_from_saved, write_hf_folder
from lightning_megatron.module import MegatronLightningModule
from lightning_megatron.saved_model import SavedModel, read_model_checkpoint

__all__ = ["DEFAULT_MODEL_CLASS", "export_hf", "export_peft", "module_class_of", "import_module_class"]

DEFAULT_MODEL_CLASS = "lightning_megatron.models.bert.module.BertLightningModule"
"""The class ``lightning-megatron fit`` builds when no class path is named: that of a checkpoint recording none."""

_CLASS_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def module_class_of(saved: SavedModel, model_class: str | None = None) -> tuple[str, str]:
    """``(class path, how it was chosen)`` for a checkpoint (the rule of the module docstring)."""
    recorded = saved.module_class or saved.hparams.get("_class_path")
    in_script = recorded is not None and recorded.startswith("__main__.")  # a class of the script that trained it
    if model_class is not None:
        same = recorded == model_class or (in_script and model_class.rpartition(".")[2] == recorded[9:])
        if recorded is not None and not same:
            raise ValueError(f"the checkpoint was written by {recorded}; --model-class {model_class} disagrees with "
                             f"it: " + (f"pass the script's {recorded[9:]} by its module's path" if in_script
                                        else "drop --model-class"))
        return model_class, "--model-class"
    if in_script:
        raise ValueError(f"the checkpoint was written by {recorded}, a class of the script that trained it (run as "
                         f"__main__, a name no other program imports): pass --model-class with its importable path, "
                         f"e.g. my_script.{recorded[9:]} (the script's folder on PYTHONPATH)")
    if saved.module_class is not None:
        return saved.module_class, "recorded in the checkpoint"
    if recorded is not None:
        return recorded, "LightningCLI's _class_path in the checkpoint's hyper-parameters"
    return DEFAULT_MODEL_CLASS, "the CLI's default model class, as the checkpoint records none"


def import_module_class(path: str, *, named_by_user: bool) -> type[MegatronLightningModule]:
    """The ``MegatronLightningModule`` subclass ``path`` names, with an ``interop`` adapter. A class outside
    ``lightning_megatron`` is imported only when the user named it (``named_by_user``)."""
    if not _CLASS_PATH.fullmatch(path):
        raise ValueError(f"the checkpoint names the class {path!r}, which cannot be imported: pass --model-class "
                         f"package.module.Class with the class that wrote it")
    if not named_by_user and not path.startswith("lightning_megatron."):
        raise ValueError(f"the checkpoint was written by {path}: export imports a class outside lightning_megatron "
                         f"only when you name it: pass --model-class {path}")
    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"the module class {path} cannot be imported ({e}): pass --model-class with the class that "
                         f"wrote the checkpoint") from e
    if not (isinstance(cls, type) and issubclass(cls, MegatronLightningModule)):
        raise ValueError(f"{path} is not a lightning_megatron.module.MegatronLightningModule")
    if cls.interop is None:
        raise ValueError(f"{path} declares no interop adapter (its class attribute interop is None): export hf has "
                         f"no Hugging Face mapping for it")
    return cls


def export_hf(ckpt_path: str | os.PathLike[str], output: str | os.PathLike[str], *,
              model_class: str | None = None, tokenizer: str | os.PathLike[str] | None = None,
              vocab_file: str | os.PathLike[str] | None = None, overwrite: bool = False) -> Path:
    """Write ``output/`` (``config.json``, ``model.safetensors``, tokenizer) from a checkpoint at any layout,
    through the ``interop`` adapter of the class that wrote it (:func:`module_class_of`).

    ``tokenizer`` / ``vocab_file`` (the CLI's ``--tokenizer`` / ``--vocab_file``; give one): the tokenizer
    files the model was trained with (BERT: a WordPiece ``vocab.txt``; the GPT family: a ``tokenizer.json``
    or GPT-2 ``vocab.json``); None takes the one the checkpoint's datamodule recorded. Its size must equal
    the model's vocabulary. A non-empty ``output`` is refused unless ``overwrite``; the folder is written
    next to it under a temporary name and swapped in whole. Returns the output directory.
    """
    if tokenizer is not None and vocab_file is not None:
        raise ValueError("--tokenizer and --vocab_file both name the tokenizer the model was trained with: give one")
    out = check_output_folder(output, overwrite)
    saved = read_model_checkpoint(ckpt_path)  # verified first: a damaged checkpoint is refused as such
    trained_on = saved.vocabulary
    path, how = module_class_of(saved, model_class)
    cls = import_module_class(path, named_by_user=model_class is not None)
    adapter = check_adapter(cls.interop, cls.__name__)
    saved = cls.whole_model(saved)  # a LoRA checkpoint: its base with the adapters merged in
    try:
        model, write_tokenizer = hf_model_from_saved(saved, adapter, tokenizer=tokenizer if vocab_file is None
                                                     else vocab_file)
    except (ValueError, KeyError) as e:
        if model_class is None and saved.module_class is None and "_class_path" not in saved.hparams:
            raise ValueError(f"{e} (exported as {cls.__name__}, {how}; if another class wrote it, pass "
                             f"--model-class package.module.Class)") from e
        raise
    def write_checked_tokenizer(folder: Path) -> None:
        write_tokenizer(folder)
        problem = exported_vocabulary_problem(trained_on, folder)
        if problem is not None:  # the folder is still the temporary one: nothing is swapped in
            raise ValueError(f"export hf {str(ckpt_path)!r}: {problem}")

    write_hf_folder(model, write_checked_tokenizer, out)
    return out


def exported_vocabulary_problem(trained_on: dict[str, Any] | None, folder: Path) -> str | None:
    """Why the tokenizer written to ``folder`` is not the vocabulary the checkpoint records its data was tokenized
    with (``trained_on``: :func:`~lightning_megatron.data.dataset_vocab.vocabulary_record`), read back as
    transformers reads it: its pieces in id order. None when they agree, or when either side says nothing (a
    checkpoint written before the record, a folder without a tokenizer)."""
    if not isinstance(trained_on, dict) or not any((folder / name).is_file() for name in (
            "tokenizer.json", "vocab.txt", "vocab.json")):
        return None
    from lightning_megatron.data.dataset_vocab import pieces_sha256
    from lightning_megatron.interop.hf_folder import import_transformers

    written = import_transformers("reading the exported tokenizer back").AutoTokenizer.from_pretrained(folder)
    pieces = [piece or "" for piece in written.convert_ids_to_tokens(list(range(len(written))))]
    if pieces_sha256(pieces) == trained_on.get("pieces_sha256"):
        return None
    return (f"the tokenizer it would write ({len(pieces)} pieces) is not the vocabulary the run's data was tokenized "
            f"with ({trained_on.get('source')}, {trained_on.get('vocab_size')} pieces, sha256 "
            f"{str(trained_on.get('pieces_sha256'))[:12]}): pass that file with --tokenizer (a decoder) or "
            f"--vocab_file (BERT)")


def export_peft(ckpt_path: str | os.PathLike[str], output: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``output/`` as a PEFT LoRA adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) from a
    LoRA checkpoint of a Llama-shaped decoder (:mod:`lightning_megatron.models.gpt.peft`): ``peft.PeftModel.from_pretrained``
    loads it onto transformers' model of the base (the run's ``init_from``, exported or as it was)."""
    from lightning_megatron.models.gpt.peft import write_peft_folder
    from lightning_megatron.transformer.lora import LoRAConfig, is_adapter_name

    out = check_output_folder(output, overwrite)
    saved = read_model_checkpoint(ckpt_path)
    lora = LoRAConfig.coerce(saved.module_hparams.get("lora"))
    if lora is None:
        raise ValueError(f"checkpoint {str(ckpt_path)!r} has no LoRA adapters (its model trained every weight): "
                         f"export the model with export hf")
    path, _ = module_class_of(saved)
    cls = import_module_class(path, named_by_user=False)
    cls.whole_model(saved)  # the base it names is there and unchanged (checksum): the adapters belong to it
    adapters = {k: v for k, v in saved.state_dict.items() if is_adapter_name(k)}
    return write_peft_folder(adapters, saved.hparams, lora, out, base_model=saved.module_hparams.get("init_from"))
