"""MegatronLightningModule: the model-agnostic half of a LightningModule for the MegatronStrategy.

A model family subclasses it and writes only what is its own::

    class MyModule(MegatronLightningModule):
        def build_chunks(self, parallel_state):         # this rank's pieces, one per virtual stage
            return [MyChunk(c.layers, c.pre_process, c.post_process, parallel_state.group("tp"))
                    for c in stage_chunks(BLOCKS, parallel_state.pp_size, parallel_state.pp_rank,
                                          parallel_state.vp_size)]
        def forward_step(self, microbatch, chunk):      # -> (output, loss_func or None)
            ...
        def pipeline_tensor_shape(self, microbatch):    # [s, b, h] sent between stages
            ...

The base gives the rest of the :class:`~lightning_megatron.protocols.MegatronModule` contract and of
Lightning's:

- the strategy hands it its :class:`~lightning_megatron.parallel_state.ParallelState` before
  ``configure_model`` (:meth:`connect_parallel_state`, as Lightning's ``ModelParallelStrategy`` hands
  a LightningModule its device mesh); without the MegatronStrategy it is one process;
- ``configure_model`` builds the chunks once (Lightning calls it again on every fit/validate/...);
- ``sharded_named_parameters``: every chunk's ``named_parameters()`` (override when a chunk's names
  depend on the layout);
- ``training_step``/``validation_step``/``test_step`` for a plain single-device Trainer (under the
  MegatronStrategy, ``forward_step`` serves every stage and these are never called);
- ``configure_optimizers`` on :func:`~lightning_megatron.optimizer.param_groups.get_param_groups`
  (no weight decay on biases and norms) with any ``torch.optim`` optimizer and LR scheduler the CLI's
  ``--optimizer`` / ``--lr_scheduler`` name (:meth:`use_optimizer`, :meth:`use_lr_scheduler`), or the
  module's :meth:`default_optimizer`;
- weights from elsewhere, at any layout (:mod:`lightning_megatron.saved_model`):
  :meth:`load_from_checkpoint` of a checkpoint directory the CLI or the strategy wrote,
  ``init_from=SOURCE`` (loaded by :meth:`load_pretrained` once the chunks exist) and
  :meth:`from_pretrained` (the architecture read from the source). Our checkpoints are read for every
  family; a family reads Hugging Face folders and Megatron-LM checkpoints (and ``export hf`` writes
  them) through the state-dict adapter its class declares, ``interop``
  (:class:`~lightning_megatron.interop.StateDictAdapter`), and names the arguments a source fixes in
  ``architecture_keys``. Every checkpoint records the class that wrote it (``module_class``), so
  ``export hf`` takes that class's adapter;
- hyper-parameters across versions: :meth:`moved_arguments` names the constructor arguments that moved
  (``num_layers`` -> ``config.num_layers``), :meth:`upgrade_hparams` maps a checkpoint's saved
  hyper-parameters with it (load, resume, ``init_from``), and the CLI refuses the old spellings, naming
  the new ones; :meth:`flat_hparams` is the flat view architecture dicts use (keyed by field names).

A language model (embedding, output layer, vocabulary) extends
:class:`~lightning_megatron.language.module.LanguageLightningModule`, which is this base with the shared
language-model half. Nothing here imports the strategy, a model family or the CLI.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_megatron.optimizer.param_groups import get_param_groups
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.checkpoint_data import VOCABULARY, data_problems, record_data, resume_differences
from lightning_megatron.saved_model import MODULE_CLASS, SavedModel, class_path
from lightning_megatron.tensor_parallel.param_facts import mark_replicated

if TYPE_CHECKING:
    from lightning_megatron.interop import StateDictAdapter

__all__ = ["MegatronLightningModule", "check_checkpoint_fits", "checkpoint_rules", "context_parallel_problem",
           "torch_class"]


def context_parallel_problem(module: Any, cp: int) -> str | None:
    """Why ``module`` (a LightningModule or its class) cannot run at ``context_parallel_size=cp``, or None:
    only a module that declares ``supports_context_parallel`` splits its sequence over the CP ranks."""
    if cp <= 1 or getattr(module, "supports_context_parallel", False):
        return None
    name = module.__name__ if isinstance(module, type) else type(module).__name__
    return (f"context_parallel_size={cp}: {name} does not split its sequence over context-parallel ranks "
            f"(supports_context_parallel is not set); use context_parallel_size=1, or a module that does "
            f"(GPTLightningModule)")


class MegatronLightningModule(LightningModule):
    """Model-agnostic base of a LightningModule for the MegatronStrategy (module docstring)."""

    init_seed: int = 1234
    """Seed of the dropout streams when no MegatronStrategy seeded them (one process)."""

    supports_context_parallel: ClassVar[bool] = False
    """Whether the module splits each sample's sequence over the ranks of the CP group (its forward step
    slices the batch and its attention gathers keys and values: ``transformer.context_parallel``)."""

    hparams_set_in_setup: ClassVar[frozenset[str]] = frozenset()
    """Hyper-parameters the module fills in while it is set up in a rank (after ``__init__``): a check of a
    checkpoint before the ranks start (:func:`check_checkpoint_fits`) leaves them to the load's."""

    def __init__(self) -> None:
        super().__init__()
        self.model_chunks: nn.ModuleList | None = None
        self.parallel_state: ParallelState | None = None
        """Groups and coordinates of this process: the strategy's, or one process (after configure_model)."""
        self._optimizer_spec: tuple[str, dict[str, Any]] | None = None
        self._lr_scheduler_spec: tuple[str, dict[str, Any]] | None = None
        self._unread_head: str | None = None  # init_from's fine-tuned head, said when a fit starts without resuming

    # ------------------------------------------------------------------ what a model family writes

    def build_chunks(self, parallel_state: ParallelState) -> Sequence[nn.Module]:
        """This rank's model chunks, one per virtual pipeline stage (``pipeline.stage_chunks`` tells
        each chunk's layers and whether it starts or ends the model)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_chunks(parallel_state)")

    def forward_step(self, microbatch: Any, chunk: nn.Module) -> tuple[Any, Any]:
        """``(output, loss_func)`` on the chunk that ends the model, ``(output, None)`` elsewhere
        (:class:`~lightning_megatron.protocols.MegatronModule`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_step(microbatch, chunk)")

    def pipeline_tensor_shape(self, microbatch: Any) -> Sequence[int]:
        """Shape of the activation sent between pipeline stages for ``microbatch``."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_tensor_shape(microbatch)")

    def head_tokens(self, microbatch: Any) -> int | None:
        """The tokens the model's head runs on in ``microbatch`` where the data decides how many (a masked LM's
        masked tokens), else None (every token, or no head): a check run's memory table predicts with the most of
        its step's microbatches (:mod:`lightning_megatron.check.memory_cli`)."""
        return None

    def step_metrics(self, num_microbatches: int) -> dict[str, torch.Tensor]:
        """Metrics of a training step the model gathers itself (logged as ``train_<name>``), after the
        schedule; called on every rank (it may reduce over the world). None by default."""
        return {}

    def default_optimizer(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """The optimizer when the CLI names none (``--optimizer``)."""
        raise NotImplementedError(f"{type(self).__name__}: no optimizer: pass --optimizer torch.optim.AdamW (CLI), "
                                  f"or implement default_optimizer(param_groups) or configure_optimizers")

    def optimizer_defaults(self) -> dict[str, float]:
        """``lr`` and ``weight_decay`` of the parameter groups when the module owns them (the CLI's
        ``--optimizer`` then may not set them); ``{}``: the optimizer's own defaults."""
        return {}

    # ------------------------------------------------------------------ set-up

    def connect_parallel_state(self, parallel_state: ParallelState) -> None:
        """Called by the MegatronStrategy once its groups exist, before ``configure_model``."""
        self.parallel_state = parallel_state

    @property
    def sequence_parallel(self) -> bool:
        """The layout's ``sequence_parallel`` (activations outside TP regions split along the sequence)."""
        return self.parallel_state is not None and self.parallel_state.dims.sequence_parallel

    @override
    def configure_model(self) -> None:
        if self.model_chunks is not None:  # called again by every fit/validate/...: build once
            return
        if self.parallel_state is None:
            from lightning_megatron.tensor_parallel.random import get_rng_tracker, model_parallel_seed

            self.parallel_state = ParallelState.single_process()
            if "model-parallel-rng" not in get_rng_tracker().get_states():
                # Without the MegatronStrategy nobody seeded the dropout streams: seed them here.
                model_parallel_seed(self.init_seed, 0)
        self.model_chunks = nn.ModuleList(self.build_chunks(self.parallel_state))
        self.on_chunks_built()
        # What the chunks did not mark is replicated across TP (the strategy declares the same at set-up;
        # without it, a checkpoint's slices need the facts here).
        mark_replicated(self.model_chunks.parameters())
        if self.hparams.get("init_from"):
            self.load_pretrained(self.hparams["init_from"])

    def on_chunks_built(self) -> None:
        """After ``model_chunks`` exist, before ``init_from``'s weights are copied into them."""

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The class that wrote the checkpoint (a plain string): `export hf` takes its interop adapter.
        checkpoint[MODULE_CLASS] = class_path(type(self))
        record_data(checkpoint, self._datamodule())  # what its ids and outputs mean (checkpoint_data.py)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint whose data meant otherwise (another vocabulary, other class names); on a resumed
        ``fit``, say what else differs (the data section, a torch LR scheduler without saved state)."""
        self._refuse_other_data(checkpoint, str(self.trainer.ckpt_path))
        if self.trainer.state.fn == "fit":
            datamodule = self._datamodule()
            for message in resume_differences(checkpoint, datamodule.hparams if datamodule is not None else None,
                                              [config.scheduler for config in self.trainer.lr_scheduler_configs]):
                rank_zero_warn(message, category=UserWarning)

    @override
    def on_fit_start(self) -> None:
        if self._unread_head and self.trainer.ckpt_path is None:  # a resumed fit's head is its checkpoint's
            rank_zero_warn(self._unread_head, category=UserWarning)
        self._unread_head = None

    def _datamodule(self) -> Any:
        """The trainer's datamodule (None without a trainer or a datamodule)."""
        return getattr(self._trainer, "datamodule", None) if self._trainer is not None else None

    def _refuse_other_data(self, recorded: Mapping[str, Any], checkpoint: str, *, labels: bool = True) -> None:
        problems = data_problems(recorded, self._datamodule(), checkpoint, labels=labels)
        if problems:
            from lightning_megatron.checkpoint_verify import CheckpointError

            raise CheckpointError("; ".join(problems))

    def sharded_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every chunk's parameters under their own names (override when they depend on the layout)."""
        assert self.model_chunks is not None, "configure_model has not run"
        for chunk in self.model_chunks:
            yield from chunk.named_parameters()

    # ------------------------------------------------------------------ hyper-parameters across versions

    @classmethod
    def config_problems(cls, hparams: Mapping[str, Any], dims: ParallelDims | None) -> list[str]:
        """What is wrong with these constructor arguments at the layout ``dims`` (None: not known yet),
        found by building the records the module builds (the pre-launch config check asks this, so each
        rule is written once, where the module enforces it); [] here: a module without records validates
        itself when it is built."""
        return []

    @classmethod
    def moved_arguments(cls) -> dict[str, str]:
        """Constructor arguments of earlier versions that live elsewhere now: ``{old name: new dotted
        name}`` (``{"num_layers": "config.num_layers"}``); none here. The one table behind
        :meth:`upgrade_hparams` (checkpoints written before the move) and the refusal of the old
        spelling in a recipe, on the command line (naming the new one) or in :meth:`with_overrides`."""
        return {}

    @classmethod
    def upgrade_hparams(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        """Saved hyper-parameters in this version's spelling: each :meth:`moved_arguments` entry put where
        it lives now (a value already there wins). Checkpoints written before a move load, resume
        and ``init_from`` through this."""
        out = dict(hparams)
        for old, new in cls.moved_arguments().items():
            if old not in out:
                continue
            value = out.pop(old)
            *path, leaf = new.split(".")
            target = out
            for part in path:
                inner = target.get(part)
                target[part] = inner = dict(inner) if isinstance(inner, Mapping) else {}
                target = inner
            target.setdefault(leaf, value)
        return out

    @classmethod
    def flat_hparams(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        """Constructor arguments in the flat spelling of architecture dicts (keyed by field name: what
        :meth:`architecture_conflicts` compares with a source's); the arguments themselves here."""
        return dict(hparams)

    @classmethod
    def moved_argument_problems(cls, names: Iterable[str], prefix: str) -> list[str]:
        """One ``"<prefix><old> is now <prefix><new>"`` per name of ``names`` that :meth:`moved_arguments`
        lists (``prefix``: how the caller spells an argument, ``--model.`` or ``model.init_args.``)."""
        moved = cls.moved_arguments()
        return [f"{prefix}{name} is now {prefix}{moved[name]}" for name in names if name in moved]

    @classmethod
    def with_overrides(cls, arguments: Mapping[str, Any], overrides: Mapping[str, Any], caller: str) -> dict[str, Any]:
        """``arguments`` with ``overrides`` on top (the keyword arguments of ``caller``); an old spelling
        (:meth:`moved_arguments`) is refused, naming the new one."""
        moved = cls.moved_arguments()
        old = [k for k in overrides if k in moved]
        if old:
            raise TypeError(f"{caller}: " + ", ".join(f"{k}=... is now {moved[k]}" for k in old)
                            + f" ({cls.__name__}'s arguments)")
        return {**arguments, **overrides}

    # ------------------------------------------------------------------ weights from elsewhere

    interop: ClassVar[StateDictAdapter | None] = None
    """The family's state-dict adapter (:class:`~lightning_megatron.interop.StateDictAdapter`): the Hugging
    Face folders and Megatron-LM checkpoints :meth:`read_pretrained` reads and ``export hf`` writes.
    None: our checkpoints only."""
    architecture_keys: tuple[str, ...] = ()
    """Constructor arguments a weight source fixes (sizes, spec...): read from it by :meth:`from_pretrained`
    and ``--model.init_from``, and checked against the module's before loading."""
    optional_pretrained: tuple[str, ...] = ()
    """Name prefixes ``init_from`` may leave at their initialization when the source lacks them."""
    unread_pretrained: tuple[str, ...] = ()
    """Name prefixes of a source's tensors ``init_from`` leaves unread: heads the module does not have (a
    pretraining model's heads, for a classifier). Any other tensor no parameter takes is refused."""
    fine_tuning_heads: tuple[str, ...] = ()
    """Name prefixes of parameters ``init_from`` never loads: a fine-tuning head the module starts at its
    initialization (a classifier). ``validate`` / ``test`` / ``predict`` of such a module need its fine-tuned
    checkpoint (``--ckpt_path``), refused before launch otherwise."""
    missing_tensors_hint: str = ""
    """Advice added to the error when a source lacks tensors the model needs."""
    architecture_flag_prefix: str = "--model."
    """How the command line spells an ``architecture_keys`` argument (``--model.<key> VALUE``)."""

    @classmethod
    def read_pretrained(cls, source: str) -> SavedModel:
        """The weights of ``source`` as a :class:`~lightning_megatron.saved_model.SavedModel` (its hparams
        restricted to ``architecture_keys``): a lightning_megatron checkpoint directory, or a Hugging Face
        folder / Megatron-LM checkpoint through the class's ``interop`` adapter."""
        from lightning_megatron.interop import read_pretrained

        return read_pretrained(source, cls.interop, architecture_keys=cls.architecture_keys, owner=cls.__name__)

    @classmethod
    def read_architecture(cls, source: str) -> dict[str, Any]:
        """The ``architecture_keys`` arguments ``source`` fixes, from its configuration (saved hyper-parameters,
        ``config.json``, Megatron-LM ``args``), without reading its tensors."""
        from lightning_megatron.interop import read_architecture

        return read_architecture(source, cls.interop, architecture_keys=cls.architecture_keys, owner=cls.__name__)

    @classmethod
    def free_arguments(cls, hparams: Mapping[str, Any]) -> frozenset[str]:
        """The architecture arguments (flat names) that size no weight of a model with ``hparams`` (the module's
        or their :meth:`flat_hparams`): a run may resume, or start from weights, with another value (a decoder
        with rope's ``max_sequence_length``: a longer context continues from the weights of a shorter one).
        None here."""
        return frozenset()

    @classmethod
    def architecture_conflicts(cls, hparams: dict[str, Any], source: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """``(key, the module's value, the source's)`` for every ``architecture_keys`` argument of ``hparams``
        that differs from the source's (a ``None`` on the source's side fixes nothing; an argument free in both,
        :meth:`free_arguments`, neither)."""
        wrong = []
        free = cls.free_arguments(source) & cls.free_arguments({**source, **hparams})
        for key in cls.architecture_keys:
            if key not in source or key not in hparams or source[key] is None or key in free:
                continue
            want, have = source[key], hparams[key]
            if isinstance(want, float) and isinstance(have, (int, float)):
                if abs(want - have) <= 1e-12 * max(abs(want), 1e-30):
                    continue
            elif want == have:
                continue
            wrong.append((key, have, want))
        return wrong

    def pretrained_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The (global name, parameter) pairs ``init_from`` fills (fine-tuning heads excluded by a family)."""
        return list(self.sharded_named_parameters())

    def load_pretrained(self, source: str | SavedModel, *, everything: bool = False) -> None:
        """Copy pretrained weights (``init_from``) into this rank's chunks, any layout (``everything``:
        every parameter, as :meth:`load_from_checkpoint` does). Refused once the optimizers exist."""
        from lightning_megatron.saved_model import load_full_state_dict, refuse_architecture

        if self._trainer is not None and self.trainer.optimizers:
            raise RuntimeError("load_pretrained after the optimizers exist would leave their fp32 main params and "
                               "state behind the new weights; load in configure_model (init_from=...)")
        assert self.model_chunks is not None and self.parallel_state is not None, "configure_model has not run"
        name = source if isinstance(source, str) else "<state dict>"
        saved = self.read_pretrained(source) if isinstance(source, str) else source
        self._refuse_other_data({VOCABULARY: saved.vocabulary}, name, labels=False)  # weights for a new head
        hparams = self.flat_hparams(self.hparams)
        refuse_architecture(self.architecture_conflicts(hparams, saved.hparams), name,
                            flag_prefix=self.architecture_flag_prefix)
        ps = self.parallel_state
        params = list(self.sharded_named_parameters()) if everything else self.pretrained_parameters()
        load_full_state_dict(list(self.model_chunks), params, saved.state_dict, coordinates=ps.coordinates,
                             sizes=ps.dims.sizes(), num_layers=hparams.get("num_layers"), source_name=name,
                             optional=() if everything else self.optional_pretrained, fresh=saved.fresh,
                             missing_hint=self.missing_tensors_hint, flag_prefix=self.architecture_flag_prefix,
                             not_taken=() if everything else self.unread_pretrained, agree=self._agree_on_loading())
        heads = sorted(k for k in saved.state_dict if self.fine_tuning_heads and k.startswith(self.fine_tuning_heads))
        if heads and not everything:  # another fine-tune's head, never read: said as a fit starts (on_fit_start)
            self._unread_head = (f"init_from={name!r} holds a fine-tuned head ({', '.join(heads)}), which init_from "
                                 f"does not read: this run starts its own head from init_seed; to go on training or to "
                                 f"evaluate that model, pass --ckpt_path {name}")
            if self._trainer is None:
                rank_zero_warn(self._unread_head, category=UserWarning)
        fresh = [n for n, _ in params if n in saved.fresh]
        if fresh and ps.tp_rank == 0 and ps.dp_rank == 0:  # once: the heads live on the last stage
            import warnings

            warnings.warn(f"init_from={name!r} has no {fresh} (its model has no such heads): they are initialised "
                          f"fresh, from init_seed", UserWarning, stacklevel=2)

    def _agree_on_loading(self) -> Any:
        """The minimum of every rank's flags (an all-reduce), where the layout splits the parameters' names
        over ranks (pipeline stages, expert ranks): which source tensors no rank takes, whether every rank
        loaded. None where each rank holds every name."""
        import torch.distributed as dist

        ps = self.parallel_state
        if ps is None or (ps.pp_size == 1 and ps.ep_size == 1) or not dist.is_initialized():
            return None
        if self._trainer is not None:
            device = self.trainer.strategy.root_device
        elif dist.get_backend() == "gloo" or torch.accelerator.current_accelerator() is None:
            device = torch.device("cpu")
        else:  # a group of an accelerator's backend, without a trainer: its current device
            accelerator = torch.accelerator.current_accelerator()
            device = torch.device(accelerator.type, torch.accelerator.current_device_index())

        def agree(flags: torch.Tensor) -> torch.Tensor:
            flags = flags.to(device)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            return flags.cpu()

        return agree

    @classmethod
    def whole_model(cls, saved: SavedModel) -> SavedModel:
        """The whole model of one of this class's checkpoints (what ``export`` converts); the checkpoint itself
        here. A module whose checkpoints hold part of the model (LoRA adapters) completes it."""
        return saved

    @classmethod
    def from_pretrained(cls, source: str, **kwargs: Any) -> MegatronLightningModule:
        """A module with the architecture of ``source`` (:meth:`read_architecture`), started from its
        weights in ``configure_model``. ``kwargs`` set the other arguments (a language model's
        ``config={"vocab_size": ...}`` the fields the source leaves open); architecture arguments among
        them must agree with the source."""
        arguments = cls.with_overrides({}, kwargs, f"{cls.__name__}.from_pretrained")
        architecture = cls.read_architecture(source)
        wrong = cls.architecture_conflicts(cls.flat_hparams(arguments), architecture)
        if wrong:
            raise ValueError(f"from_pretrained({source!r}): " + ", ".join(
                f"{k}={h!r} but the source has {w!r}" for k, h, w in wrong) + ": drop these arguments")
        return cls(**cls.with_overrides(cls.upgrade_hparams(architecture), arguments, "from_pretrained"),
                   init_from=source)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                             strict: bool | None = None, **kwargs: Any) -> Any:
        """A single-process module from a lightning_megatron checkpoint directory (any layout it was
        saved at, by the CLI or the strategy), built with the saved hyper-parameters (``kwargs`` override
        them) and the weights loaded; or Lightning's loader for a single-file checkpoint. To continue
        training at a layout, use ``trainer.fit(model, ckpt_path=...)``; to start a new run from the
        weights, ``init_from``."""
        from pathlib import Path

        from lightning_megatron import checkpoint as ckpt
        from lightning_megatron.saved_model import read_model_checkpoint

        path = Path(checkpoint_path) if isinstance(checkpoint_path, (str, Path)) else None
        if path is None or not path.is_dir():
            # Lightning's loader, weights only: it unpickled an http(s) URL with weights_only=False by default (a
            # payload in the file ran); no argument turns that back on here
            if kwargs.pop("weights_only", True) is not True:
                raise ValueError(f"{cls.__name__}.load_from_checkpoint(weights_only=False) is refused: a checkpoint "
                                 f"is read with torch.load(weights_only=True) only, never unpickled as code")
            return super().load_from_checkpoint(checkpoint_path, map_location=map_location,
                                                hparams_file=hparams_file, strict=strict, weights_only=True, **kwargs)
        if not (path / ckpt.MARKER).is_file():
            raise ckpt.CheckpointError(
                f"{str(path)!r} is a directory but not a lightning_megatron checkpoint ({ckpt.MARKER} missing); "
                f"{cls.__name__}.load_from_checkpoint reads lightning_megatron checkpoint directories or "
                f"single-file Lightning checkpoints")
        saved = read_model_checkpoint(path)
        module = cls(**cls.checkpoint_arguments(saved, kwargs))
        module.configure_model()
        module.load_pretrained(saved, everything=True)
        if map_location is not None:
            module.to(map_location)
        return module.eval()

    @classmethod
    def checkpoint_arguments(cls, saved: SavedModel, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor arguments of a module rebuilt from a checkpoint (:meth:`load_from_checkpoint`):
        its saved hyper-parameters in this version's spelling (:meth:`upgrade_hparams`), ``overrides`` on
        top, and no ``init_from`` (the checkpoint's own weights, not its start's)."""
        # LightningCLI records how it built the module (``_instantiator``, ``_class_path``): not arguments.
        hparams = cls.upgrade_hparams({k: v for k, v in saved.module_hparams.items() if not k.startswith("_")})
        hparams = cls.with_overrides(hparams, overrides, f"{cls.__name__}.load_from_checkpoint")
        if "init_from" in hparams:
            hparams["init_from"] = None
        return hparams

    # ------------------------------------------------------------------ steps without the strategy

    def _whole_batch(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        assert self.model_chunks is not None and len(self.model_chunks) == 1
        output, loss_func = self.forward_step(batch, self.model_chunks[0])
        return loss_func(output)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # Used without the MegatronStrategy (single device): the whole batch is one microbatch.
        loss, stats = self._whole_batch(batch)
        for k, v in stats.items():
            self.log(k if k == "loss" else f"train_{k}", v, prog_bar=k == "loss")
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, stats = self._whole_batch(batch)
        for k, v in stats.items():
            self.log(f"val_{k}", v)
        return loss

    @override
    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, stats = self._whole_batch(batch)
        for k, v in stats.items():
            self.log(f"test_{k}", v)
        return loss

    # ------------------------------------------------------------------ optimizer

    @classmethod
    def default_optimizer_class(cls, hparams: Mapping[str, Any]) -> type | None:
        """The class :meth:`default_optimizer` builds for these constructor arguments, when it can be told without
        building the module (a resume's optimizer state is checked against it before launch); None here."""
        return None

    def use_optimizer(self, class_path: str | None, init_args: dict[str, Any] | None = None) -> None:
        """Build ``configure_optimizers``' optimizer as ``torch.optim.<class_path>(param_groups, **init_args)``
        (the CLI's ``--optimizer``); None: :meth:`default_optimizer`."""
        self._optimizer_spec = (class_path, dict(init_args or {})) if class_path else None

    def use_lr_scheduler(self, class_path: str | None, init_args: dict[str, Any] | None = None) -> None:
        """A ``torch.optim.lr_scheduler`` scheduler stepped every optimizer step (the CLI's ``--lr_scheduler``)."""
        self._lr_scheduler_spec = (class_path, dict(init_args or {})) if class_path else None

    def _param_groups(self, defaults: dict[str, float]) -> list[dict[str, Any]]:
        """:func:`get_param_groups` of the chunks; ``lr`` / ``weight_decay`` the module does not own are
        left to the optimizer's arguments (a no-decay group keeps its ``weight_decay=0``)."""
        assert self.model_chunks is not None, "configure_model has not run"
        groups = get_param_groups(list(self.model_chunks), lr=defaults.get("lr", 1.0),
                                  weight_decay=defaults.get("weight_decay", 1.0))
        for g in groups:
            if "lr" not in defaults and g["lr_mult"] == 1.0:
                del g["lr"]
            if "weight_decay" not in defaults and g["wd_mult"] != 0.0:
                del g["weight_decay"]
        return groups

    @override
    def configure_optimizers(self) -> Any:
        """The optimizer on :func:`get_param_groups` (and the LR scheduler, stepped every step)."""
        assert self.model_chunks is not None, "configure_model has not run"
        defaults = self.optimizer_defaults()
        groups = self._param_groups(defaults)
        if self._optimizer_spec is None:
            optimizer = self.default_optimizer(groups)
        else:
            path, kwargs = self._optimizer_spec
            cls = torch_class(path, torch.optim, torch.optim.Optimizer, "optimizer_class", "optimizer",
                              "torch.optim.SGD, torch.optim.NAdam")
            for name in defaults:
                if name in kwargs:
                    raise ValueError(f"optimizer_kwargs sets {name}={kwargs[name]!r}: the parameter groups take "
                                     f"it from the model's {name} (--model.{name}); drop it from the optimizer's "
                                     f"arguments")
            optimizer = cls(groups, **defaults, **kwargs)
        if self._lr_scheduler_spec is None:
            return optimizer
        path, kwargs = self._lr_scheduler_spec
        cls = torch_class(path, torch.optim.lr_scheduler, torch.optim.lr_scheduler.LRScheduler,
                          "lr_scheduler_class", "LR scheduler", "torch.optim.lr_scheduler.StepLR, ...")
        scheduler = cls(optimizer, **kwargs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def checkpoint_rules(module: LightningModule) -> dict[str, Any]:
    """How ``module``'s hyper-parameters are compared with a checkpoint's (the keywords of
    :func:`lightning_megatron.checkpoint.load` and ``hparam_problems``): its ``__init__`` defaults for what an older
    checkpoint does not record, and a :class:`MegatronLightningModule`'s ``upgrade_hparams`` and ``free_arguments``."""
    from lightning_megatron import checkpoint as ckpt

    cls = type(module) if isinstance(module, MegatronLightningModule) else None
    return {"hparam_defaults": ckpt.init_defaults(type(module)), "upgrade_hparams": cls and cls.upgrade_hparams,
            "free_arguments": cls and cls.free_arguments}


def check_checkpoint_fits(module: MegatronLightningModule, ckpt_path: str | os.PathLike) -> None:
    """Refuse, before any rank starts, a checkpoint whose saved hyper-parameters ``module`` does not have (the
    errors the load in every rank would raise, as :func:`lightning_megatron.checkpoint.does_not_fit` words them);
    the tensors' shapes, the optimizer and the differences allowed stay the load's. Reads only the checkpoint's
    marker and ``extra.pt`` (:func:`~lightning_megatron.checkpoint.saved_extra`)."""
    from lightning_megatron import checkpoint as ckpt

    saved = ckpt.saved_extra(ckpt_path)
    if saved is None:
        return
    hparams, layout = dict(saved[0].get("hyper_parameters") or {}), saved[1].get("layout")
    later = module.hparams_set_in_setup
    errors, _ = ckpt.hparam_problems({k: v for k, v in hparams.items() if k not in later},
                                     {k: v for k, v in module.hparams.items() if k not in later},
                                     **checkpoint_rules(module))
    if errors:
        raise ckpt.does_not_fit(ckpt_path, layout, errors)


def torch_class(path: str, namespace: Any, base: type, arg: str, kind: str, examples: str) -> type:
    """A class of ``namespace`` (torch.optim or torch.optim.lr_scheduler) by name; nothing else is imported."""
    cls = getattr(namespace, path.removeprefix(namespace.__name__ + "."), None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{arg}={path!r} is not a {namespace.__name__} {kind} (e.g. {examples})")
    return cls
