"""What a checkpoint records of its run's data, and what a run that loads it compares.

Besides Lightning's state, ``extra.pt`` records what the model's numbers mean:

- ``vocabulary`` (:data:`VOCABULARY`): the vocabulary the data was tokenized with, its size and the sha256 of its
  pieces in id order (:func:`~lightning_megatron.data.dataset_vocab.vocabulary_record`): ids of another vocabulary
  of the same size are valid and mean other text;
- ``label_names`` (:data:`LABEL_NAMES`): a classifier's class names in class-id order: in another order every
  prediction and metric names another class.

:func:`data_problems` refuses data that means otherwise (the module at set-up, on ``ckpt_path`` and ``init_from``;
:mod:`lightning_megatron.data_checks` before launch, on the datamodule the data section builds: one rule).
:func:`resume_differences` says what a resumed ``fit`` changes that may be meant (the data section, a torch LR
scheduler the checkpoint holds no state of). Importing it imports neither Lightning nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["LABEL_NAMES", "VOCABULARY", "data_label_names", "data_problems", "label_names_mismatch", "record_data",
           "resume_differences"]

VOCABULARY = "vocabulary"
"""The ``extra.pt`` entry recording the vocabulary the run's data was tokenized with."""
LABEL_NAMES = "label_names"
"""The ``extra.pt`` entry recording a classifier's class names in class-id order (its datamodule's ``label_names``)."""


def _tokenizer(datamodule: Any) -> Any:
    return getattr(datamodule, "tokenizer", None) if datamodule is not None else None


def data_label_names(datamodule: Any) -> list[str] | None:
    """The datamodule's class names (``label_names``, in class-id order), else None."""
    labels = getattr(datamodule, "label_names", None) if datamodule is not None else None
    return [str(label) for label in labels] if isinstance(labels, (list, tuple)) else None


def record_data(checkpoint: dict[str, Any], datamodule: Any) -> None:
    """Write :data:`VOCABULARY` and :data:`LABEL_NAMES` of ``datamodule`` into ``checkpoint`` (where it has them)."""
    from lightning_megatron.data.dataset_vocab import vocabulary_record

    vocabulary = vocabulary_record(_tokenizer(datamodule))
    if vocabulary is not None:
        checkpoint[VOCABULARY] = vocabulary
    labels = data_label_names(datamodule)
    if labels is not None:
        checkpoint[LABEL_NAMES] = labels


def label_names_mismatch(saved: Any, current: Any, checkpoint: str, argument: str = "labels") -> str | None:
    """Why a classifier trained with the class names ``saved`` (in class-id order) must not read data that names
    ``current`` (its ``argument``). None when they agree or either is unknown."""
    if not isinstance(saved, (list, tuple)) or not isinstance(current, (list, tuple)) or list(saved) == list(current):
        return None
    return (f"checkpoint {checkpoint!r} was trained with the classes {list(saved)} (in class-id order); this run's "
            f"data names {list(current)}: every prediction and metric would name another class; pass the run's "
            f"{argument} in their order (--data.{argument} '[{', '.join(map(str, saved))}]')")


def data_problems(recorded: Mapping[str, Any], datamodule: Any, checkpoint: str, *, labels: bool = True) -> list[str]:
    """What ``datamodule``'s data means otherwise than the checkpoint's ``recorded`` entries say: another vocabulary,
    and (``labels``: a checkpoint loaded whole, not ``init_from``'s weights for a new head) other class names.
    An entry the checkpoint predates, or a datamodule without a tokenizer or class names, is not judged."""
    from lightning_megatron.data.dataset_vocab import vocabulary_mismatch

    problems = []
    if isinstance(recorded.get(VOCABULARY), dict):
        problems += [p for p in [vocabulary_mismatch(recorded[VOCABULARY], _tokenizer(datamodule), checkpoint)] if p]
    if labels:
        argument = getattr(type(datamodule), "labels_argument", "labels")  # FinetuneDataModule's
        problems += [p for p in [label_names_mismatch(recorded.get(LABEL_NAMES), data_label_names(datamodule),
                                                      checkpoint, argument)] if p]
    return problems


def resume_differences(checkpoint: Mapping[str, Any], datamodule_hparams: Mapping[str, Any] | None,
                       lr_schedulers: list[Any]) -> list[str]:
    """What a resumed ``fit`` changes that may be meant, to be said: the data section's arguments (a curriculum
    changes them on purpose; a forgotten ``--data.data_prefix`` takes the built-in corpus; the ``predict_*`` options
    are left out), and the torch LR schedulers (``lr_schedulers``) the checkpoint holds no state of (Lightning
    restores the ones it has and says nothing of the others: they start from their own first step)."""
    from lightning_megatron.sharded_state import plain

    said = []
    saved = checkpoint.get("datamodule_hyper_parameters")
    if isinstance(saved, Mapping) and saved and datamodule_hparams is not None:
        saved, current = plain(dict(saved)), plain(dict(datamodule_hparams))
        differ = [f"{key}: checkpoint {saved.get(key, '<absent>')!r}, this run {current.get(key, '<absent>')!r}"
                  for key in sorted(set(saved) | set(current))
                  if not key.startswith("predict") and saved.get(key) != current.get(key)]
        if differ:
            said.append(f"the data section differs from the checkpoint's run ({'; '.join(differ)}): the run "
                        f"continues on this data; resume with the run's data section if that is not what you meant")
    fresh = lr_schedulers[len(checkpoint.get("lr_schedulers") or []):]
    if fresh and checkpoint.get("global_step", 0) > 0:
        names = ", ".join(type(scheduler).__name__ for scheduler in fresh)
        said.append(f"the checkpoint at step {checkpoint['global_step']} holds no state of the LR scheduler {names} "
                    f"this run configures (it was trained with another schedule, or none): it starts from its own "
                    f"first step here")
    return said
