"""LanguageLightningModule: the language-model half every model family's LightningModule shares.

A :class:`~lightning_megatron.module.MegatronLightningModule` (the strategy's ``parallel_state``,
chunks built once, steps without the strategy, weights from elsewhere) for models whose chunks are
:class:`~lightning_megatron.language.model.LanguageModule` s, configured by one record, a
:class:`~lightning_megatron.language.config.LanguageModelConfig` subclass (``config_class``). Once here:

- the constructor's shared options (seed, the optimizer and its hyper-parameters, ``compile``,
  ``init_from``, ``--optimizer`` / ``--lr_scheduler``) and the record saved as a plain dict in the
  hyper-parameters (``hparams["config"]``: a checkpoint loads with ``weights_only=True``);
- ``build_chunks``: the record at the strategy's layout (a layout field the record sets must agree),
  the vocabulary (the record's, else the datamodule's), one chunk per virtual pipeline stage from the
  family's :meth:`build_chunk`, regional compilation;
- ``sharded_named_parameters`` (global layer numbers), ``pipeline_tensor_shape`` ([s, b, h]; [s/t, b, h]
  under sequence parallelism);
- ``forward_step``: predicting, the family's :meth:`predict_forward` (the generation hook: generated
  tokens, masked-LM top-k, ...), logged as ``predictions``; otherwise the family's :meth:`loss_forward`
  (the loss hook: the last chunk's loss and its logged statistics);
- the ``adam`` / ``adamw`` / ``sgd`` default optimizer and its defaults;
- the hyper-parameters of checkpoints written before the record: the config fields were constructor
  arguments (``num_layers=...``); :meth:`moved_arguments` maps them into ``config`` (load, resume,
  export) and the CLI refuses the old spelling, naming the new one.

A family writes ``config_class``, ``build_chunk``, ``loss_forward`` (and ``predict_forward``), what its
checkpoints and costs need (``architecture_keys``, ``estimate_shape``, ``training_flops``) and its metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from typing_extensions import override

from lightning_megatron.language.config import LanguageModelConfig
from lightning_megatron.language.model import LanguageModule
from lightning_megatron.module import MegatronLightningModule
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.parallel_state import ParallelState
from lightning_megatron.pipeline.layout import ChunkLayout, stage_chunks
from lightning_megatron.checkpoint import CONFIG_HPARAM
from lightning_megatron.saved_model import SavedModel
from lightning_megatron.transformer.config import ConfigProblems
from lightning_megatron.transformer.lora import LoRAConfig, add_lora

__all__ = ["LanguageLightningModule"]

OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
"""``optimizer``: the class it names (:meth:`LanguageLightningModule.default_optimizer`)."""
OPTIMIZERS = tuple(OPTIMIZER_CLASSES)


def compile_problem(config: LanguageModelConfig, compile: Any) -> str | None:
    """``compile=True`` with selective recomputation and attention dropout: the compiled layer's recomputed core
    attention draws other dropout masks than its forward did, so the gradients are not the loss's (worst gradient
    0.45 off at TP=1, the loss equal; eager and full recomputation are exact). Refused, naming the ways out."""
    dropout = config.attention_dropout
    if not compile or config.recompute_granularity != "selective" or not dropout > 0:
        return None
    return (f"compile=True with recompute_granularity='selective' and attention_dropout={dropout}: the compiled layer "
            f"recomputes attention with other dropout masks than its forward's (its gradients would not be the "
            f"loss's); use recompute_granularity='full', attention_dropout=0, or compile=False")


class LanguageLightningModule(MegatronLightningModule):
    """A language model for the MegatronStrategy, any TP x SP x PP x VP x DP layout (module docstring).

    Args:
        config: the model's record (``config_class``; None: its defaults), which the module copies. A
            mapping of its fields is taken too (saved hyper-parameters). The layout fields are the strategy's.
        init_seed: seed of the layout-independent weight initialization (and of the dropout streams
            without the MegatronStrategy).
        optimizer: "adamw", "adam" or "sgd"; ``lr``, ``weight_decay``, ``adam_beta1``, ``adam_beta2``,
            ``adam_eps``, ``sgd_momentum`` as in torch. The learning rate is usually driven by the
            OptimizerParamSchedulerCallback.
        fused_optimizer: torch's fused Adam/AdamW kernel (CPU and CUDA): one pass over all parameters
            instead of a loop (docs/benchmarks.md, "Figures behind the code").
        compile: ``torch.compile`` each transformer layer (regional compilation: one compiled region per
            layer, reused by every layer of the same shapes) and, with one TP rank, the loss (its passes over
            the logits fused, no fp32 copy of them kept for the backward); equal to eager within fp32 tolerance
            (tests/test_compile.py). The first steps pay the compilation.
        init_from: start from pretrained weights (any layout): a lightning_megatron checkpoint directory
            or a source the family reads (Hugging Face folders, Megatron-LM checkpoints; docs/interop.md).
            Ignored when a checkpoint is resumed (``ckpt_path``), which restores its own weights.
        optimizer_class, optimizer_kwargs: any ``torch.optim`` optimizer by name (``torch.optim.SGD``,
            ``NAdam``...), replacing ``optimizer``; built on the same parameter groups (no weight decay on
            biases and norms) with ``lr``, ``weight_decay`` and ``optimizer_kwargs``. The CLI sets both from
            ``--optimizer torch.optim.SGD --optimizer.momentum 0.9`` (docs/recipes.md).
        lr_scheduler_class, lr_scheduler_kwargs: a ``torch.optim.lr_scheduler`` scheduler by name and its
            arguments, stepped every optimizer step (CLI: ``--lr_scheduler ...``); not together with the
            OptimizerParamSchedulerCallback, which also sets the lr.
        lora: LoRA adapters (:class:`~lightning_megatron.transformer.lora.LoRAConfig`: rank, alpha, dropout,
            target_modules; CLI ``--model.lora.rank 8``) on the transformer's projections, added once the
            chunks hold their starting weights (``init_from``); every other parameter is frozen, outside the
            optimizer and the gradient buffer, and checkpoints hold the adapters alone with a checksum of the
            base they adapt (docs/finetune.md).
        init_from_sha256: the checksum ``init_from``'s weights must have (:func:`~lightning_megatron.saved_model.state_digest`
            of its tensors), checked before they load. A LoRA run records it: its checkpoints hold the adapters
            only, and every later load of them (resume, ``load_from_checkpoint``, ``export``) reads ``init_from``
            again and refuses other weights than the ones the adapters were trained on.

    Training, validation and test run ``forward_step`` through the strategy's microbatch schedule; a
    ``training_step`` override is NOT called under the MegatronStrategy (override ``forward_step``
    instead), and the strategy warns when it finds one.
    """

    config_class: ClassVar[type[LanguageModelConfig]] = LanguageModelConfig
    """The family's record: what ``config`` is (``BertConfig``, ``GPTConfig``)."""
    architecture_flag_prefix = "--model.config."
    hparams_set_in_setup = frozenset({"init_from_sha256"})  # a LoRA module's base, checksummed as it is read

    def __init__(
        self,
        config: LanguageModelConfig | None = None,
        *,
        init_seed: int = 1234,
        optimizer: Literal["adamw", "adam", "sgd"] = "adamw",
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_eps: float = 1e-8,
        sgd_momentum: float = 0.9,
        fused_optimizer: bool = True,
        compile: bool = False,
        init_from: str | None = None,
        optimizer_class: str | None = None,
        optimizer_kwargs: dict[str, Any] | None = None,
        lr_scheduler_class: str | None = None,
        lr_scheduler_kwargs: dict[str, Any] | None = None,
        lora: LoRAConfig | None = None,
        init_from_sha256: str | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} must be 'adamw', 'adam' or 'sgd'")
        self.config = self.config_class.coerce(config)
        """The model's record; once the chunks are built, at the strategy's layout (the chunks' config)."""
        self.vocab_size: int | None = self.config.vocab_size
        """The real vocabulary: the record's, else (once the chunks are built) the datamodule's."""
        # Every __init__ of the class chain (a family's and a subclass's arguments too; under LightningCLI
        # the parsed ones), then the record as a plain dict of its fields (weights_only=True loads it).
        self.save_hyperparameters()
        self.lora = LoRAConfig.coerce(lora)
        """The LoRA adapters' settings, or None (every parameter trains)."""
        self.save_hyperparameters({**self.hparams, CONFIG_HPARAM: self.config.as_dict(),
                                   "lora": self.lora.as_dict() if self.lora is not None else None})
        self.init_seed = init_seed
        self.use_optimizer(optimizer_class, optimizer_kwargs)
        self.use_lr_scheduler(lr_scheduler_class, lr_scheduler_kwargs)

    # ------------------------------------------------------------------ what a family writes

    def build_chunk(self, config: LanguageModelConfig, place: ChunkLayout, parallel_state: ParallelState) -> LanguageModule:
        """The chunk of ``place`` (its global ``layers``, ``pre_process``, ``post_process``) with ``config``
        at the strategy's layout and ``self.vocab_size`` resolved."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_chunk(config, place, parallel_state)")

    def loss_forward(self, microbatch: Any, chunk: LanguageModule) -> Any:
        """The loss hook: run ``chunk`` on ``microbatch``; the hidden states on a chunk that does not end the
        model, ``(loss, {name: scalar tensor to log})`` on the one that does."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss_forward(microbatch, chunk)")

    def predict_forward(self, microbatch: Any, chunk: LanguageModule) -> Any:
        """The generation hook: what ``predict`` returns for ``microbatch`` (a tensor or a dict of them) on
        the chunk that ends the model; the hidden states elsewhere."""
        raise NotImplementedError(f"{type(self).__name__} does not predict: implement predict_forward")

    # ------------------------------------------------------------------ model

    @override
    def step_metrics(self, num_microbatches: int) -> dict[str, torch.Tensor]:
        """Mixture of experts: each layer's load-balancing and z-loss and its experts' share of the tokens
        (:func:`~lightning_megatron.transformer.moe.stats.moe_metrics`)."""
        if not self.config.num_moe_experts:
            return {}
        from lightning_megatron.transformer.moe.stats import moe_metrics

        return moe_metrics(self.model_chunks, self.parallel_state, num_layers=self.config.num_layers,
                           num_experts=self.config.num_moe_experts, num_microbatches=num_microbatches)

    @override
    def build_chunks(self, parallel_state: ParallelState) -> list[LanguageModule]:
        config = self.config.with_layout(parallel_state.tp_size, self.sequence_parallel, parallel_state.ep_size)
        self.config = config
        self.vocab_size = self.resolved_vocab_size()
        chunks = []
        for place in stage_chunks(config.num_layers, parallel_state.pp_size, parallel_state.pp_rank,
                                  parallel_state.vp_size,
                                  num_layers_in_first_pipeline_stage=config.num_layers_in_first_pipeline_stage,
                                  num_layers_in_last_pipeline_stage=config.num_layers_in_last_pipeline_stage):
            chunk = self.build_chunk(config, place, parallel_state)
            fitting = self._trainer is not None and self.trainer.state.fn == "fit"
            problem = compile_problem(config, self.hparams.compile) if fitting else None
            if problem is not None:  # a training run's backward only: evaluating and predicting recompute nothing
                raise ValueError(problem)
            if self.hparams.compile:
                chunk.compile_layers()
                if chunk.post_process:
                    chunk.compile_loss()
            chunks.append(chunk)
        return chunks

    @override
    def configure_model(self) -> None:
        built = self.model_chunks is not None
        super().configure_model()  # the chunks, with init_from's weights
        if not built and self.lora is not None:
            if not self.hparams.get("init_from"):
                raise ValueError(f"{type(self).__name__}(lora=...) adapts pretrained weights: set init_from (a Hugging "
                                 f"Face folder or a checkpoint); its checkpoints hold the adapters only")
            for chunk in self.model_chunks:
                add_lora(chunk, self.lora, global_names={id(p): n for n, p in chunk.global_named_parameters()})

    @override
    def load_pretrained(self, source: str | SavedModel, *, everything: bool = False) -> None:
        """As the base; ``init_from``'s weights are checked against ``init_from_sha256`` when it is set, and a LoRA
        module records their checksum there (its checkpoints name the base they adapt)."""
        if isinstance(source, str) and (self.lora is not None or self.hparams.get("init_from_sha256")):
            from lightning_megatron.saved_model import state_digest

            saved = self.read_pretrained(source)
            digest, want = state_digest(saved.state_dict), self.hparams.get("init_from_sha256")
            if want is not None and digest != want:
                raise ValueError(f"init_from={source!r}: its weights have sha256 {digest}, but init_from_sha256={want} "
                                 f"(the weights the adapters were trained on): point init_from at that base model")
            self.hparams["init_from_sha256"] = digest
            source = saved
        super().load_pretrained(source, everything=everything)

    def resolved_vocab_size(self) -> int:
        """``config.vocab_size``, else the datamodule's ``vocab_size`` (a recipe's ``vocab_size: null`` takes
        the tokenizer's). Refuses when neither says."""
        vocab_size = self.config.vocab_size
        if vocab_size is None:
            datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
            vocab_size = getattr(datamodule, "vocab_size", None)
            if vocab_size is None:
                raise ValueError(f"{type(self).__name__}: config.vocab_size is None and the datamodule has no "
                                 f"vocab_size; set config.vocab_size=... or use a datamodule with a vocab_size")
        return int(vocab_size)

    @override
    def sharded_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under layout-independent names: global layer numbers, no chunk index. With LoRA adapters,
        the adapters alone (what trains and what checkpoints hold; the frozen base comes from ``init_from``)."""
        assert self.model_chunks is not None, "configure_model has not run"
        for chunk in self.model_chunks:
            for name, p in chunk.global_named_parameters():
                if self.lora is None or p.requires_grad:
                    yield name, p

    @override
    def pipeline_tensor_shape(self, microbatch: Mapping[str, torch.Tensor]) -> Sequence[int]:
        """[s, b, h] exchanged between stages ([s/t, b, h] under sequence parallelism; s/cp under context
        parallelism)."""
        b, s = microbatch["tokens"].shape
        if self.parallel_state is not None:
            s //= self.parallel_state.cp_size
        if self.config.sequence_parallel:
            s //= self.config.tensor_model_parallel_size
        return (s, b, self.config.hidden_size)

    # ------------------------------------------------------------------ steps

    @override
    def forward_step(self, microbatch: Any, chunk: LanguageModule) -> tuple[Any, Any]:
        """Megatron's forward step: ``(output, loss_func)`` on the chunk that ends the model, ``(output,
        None)`` elsewhere. Predicting, the loss function logs :meth:`predict_forward`'s output as
        ``predictions`` (the strategy concatenates them over the microbatches)."""
        if self._trainer is not None and self.trainer.predicting:
            output = self.predict_forward(microbatch, chunk)
            if not chunk.post_process:
                return output, None
            device = microbatch["tokens"].device

            def predictions(_: Any) -> tuple[torch.Tensor, dict[str, Any]]:
                return torch.zeros((), device=device), {"predictions": output}

            return output, predictions
        output = self.loss_forward(microbatch, chunk)
        if not chunk.post_process:
            return output, None
        loss, stats = output

        def loss_func(value: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return value, {"loss": value.detach(), **stats}

        return loss, loss_func

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """:meth:`predict_forward` of the batch without pipelining (with it, the strategy runs
        ``forward_step`` over the microbatches and returns the same on the last stage)."""
        assert self.model_chunks is not None and len(self.model_chunks) == 1, "predict_step runs one chunk"
        return self.predict_forward(batch, self.model_chunks[0])

    # ------------------------------------------------------------------ optimizer

    @override
    def optimizer_defaults(self) -> dict[str, float]:
        return {"lr": self.hparams.lr, "weight_decay": self.hparams.weight_decay}

    @classmethod
    @override
    def default_optimizer_class(cls, hparams: Mapping[str, Any]) -> type | None:
        return OPTIMIZER_CLASSES.get(str(hparams.get("optimizer", "adamw")))

    @override
    def default_optimizer(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """``optimizer``: "adamw", "adam" or "sgd" with the module's lr, weight decay, betas, eps, momentum."""
        hp = self.hparams
        cls = OPTIMIZER_CLASSES[hp.optimizer]
        if cls is torch.optim.SGD:
            return cls(param_groups, lr=hp.lr, momentum=hp.sgd_momentum, weight_decay=hp.weight_decay)
        return cls(param_groups, lr=hp.lr, betas=(hp.adam_beta1, hp.adam_beta2), eps=hp.adam_eps,
                   weight_decay=hp.weight_decay, fused=hp.fused_optimizer or None)

    # ------------------------------------------------------------------ hyper-parameters across versions

    @classmethod
    @override
    def config_problems(cls, hparams: Mapping[str, Any], dims: ParallelDims | None) -> list[str]:
        """The record built as :meth:`build_chunks` builds it: its own rules, and at the layout's TP size
        and sequence parallelism the TP-dependent ones (heads, ffn, grouped-query groups, qkv rows)."""
        try:
            config = cls.config_class.coerce(hparams.get(CONFIG_HPARAM))
            if dims is not None:
                config.with_layout(dims.tp, dims.sequence_parallel, dims.ep)
        except (TypeError, ValueError) as e:
            return [f"model.{CONFIG_HPARAM}: {p}" for p in (e.problems if isinstance(e, ConfigProblems) else [str(e)])]
        try:
            lora = LoRAConfig.coerce(hparams.get("lora"))
        except (TypeError, ValueError) as e:
            return [f"model.{e}" if str(e).startswith("lora") else f"model.lora: {e}"]
        if lora is not None and not hparams.get("init_from"):
            return ["model.lora adapts pretrained weights: set model.init_from (a Hugging Face folder or a checkpoint); "
                    "its checkpoints hold the adapters only"]
        experts = [m for m in ("linear_fc1", "linear_fc2") if m in lora.target_modules] if lora is not None else []
        if experts and config.num_moe_experts:
            return [f"model.lora.target_modules={list(lora.target_modules)!r} adapt {' and '.join(experts)}, which are "
                    f"a mixture of experts' projections in this model (num_moe_experts={config.num_moe_experts}): LoRA "
                    f"adapts the attention's only here; set --model.lora.target_modules '[linear_qkv, linear_proj]'"]
        column = {"linear_qkv", "linear_fc1"} & set(lora.target_modules) if lora is not None else set()
        if column and dims is not None and lora.rank % dims.tp:
            return [f"model.lora.rank={lora.rank} must be divisible by tensor_model_parallel_size={dims.tp} (the "
                    f"adapters of {sorted(column)} split their rank over TP): choose a multiple of {dims.tp}"]
        if dims is not None and dims.ep > 1 and not config.num_moe_experts:
            return [f"model.{CONFIG_HPARAM}: expert_model_parallel_size={dims.ep} but the model has no experts "
                    f"(num_moe_experts is None); use expert_model_parallel_size=1, or a spec with a mixture of experts "
                    f"(spec: llama_moe_layer_spec, num_moe_experts: ...)"]
        heads = config.num_attention_heads // (dims.tp if dims is not None else 1)
        if dims is not None and dims.cp > 1 and config.cp_comm_type == "a2a" and heads % dims.cp:
            return [f"model.{CONFIG_HPARAM}: cp_comm_type='a2a' splits the {heads} attention heads of a tensor-parallel "
                    f"rank over context_parallel_size={dims.cp}, which does not divide them; use "
                    f"cp_comm_type='all_gather'"]
        return []

    @classmethod
    @override
    def moved_arguments(cls) -> dict[str, str]:
        """Every field of the record was a constructor argument before the record: ``num_layers`` ->
        ``config.num_layers``."""
        return {f.name: f"{CONFIG_HPARAM}.{f.name}" for f in dataclasses.fields(cls.config_class) if f.init}

    @classmethod
    @override
    def upgrade_hparams(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        """As the base (flat fields into ``config``), and the record's fields resolved as the record resolves
        them (``ffn_hidden_size: None`` -> ``4 * hidden_size``, ``params_dtype: bf16`` -> ``bfloat16``): what
        the module saves, so a checkpoint of either spelling compares field by field with a module."""
        out = super().upgrade_hparams(hparams)
        out[CONFIG_HPARAM] = cls.config_class.coerce(out.get(CONFIG_HPARAM) or {}).as_dict()
        return out

    @classmethod
    @override
    def flat_hparams(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        config = hparams.get(CONFIG_HPARAM)
        if isinstance(config, LanguageModelConfig):
            config = config.as_dict()
        rest = {k: v for k, v in hparams.items() if k != CONFIG_HPARAM}
        return {**rest, **(config or {})}

    @classmethod
    @override
    def with_overrides(cls, arguments: Mapping[str, Any], overrides: Mapping[str, Any], caller: str) -> dict[str, Any]:
        """As the base; a ``config`` override is a mapping of the fields it changes (merged into ``arguments``'
        record), or a whole record."""
        out = super().with_overrides(arguments, overrides, caller)
        config, given = arguments.get(CONFIG_HPARAM), overrides.get(CONFIG_HPARAM)
        if isinstance(given, Mapping) and not isinstance(given, LanguageModelConfig):
            base = config.as_dict() if isinstance(config, LanguageModelConfig) else dict(config or {})
            out[CONFIG_HPARAM] = {**base, **given}
        return out

    @classmethod
    @override
    def whole_model(cls, saved: SavedModel) -> SavedModel:
        """A LoRA checkpoint (adapters only) with its base: ``init_from`` read again, checked against the recorded
        ``init_from_sha256``, and the adapters merged into it (``W + alpha / r * B A``); others as they are."""
        lora = LoRAConfig.coerce(saved.module_hparams.get("lora"))
        if lora is None:
            return saved
        from lightning_megatron.saved_model import state_digest
        from lightning_megatron.transformer.lora import merged_state_dict

        source, want = saved.module_hparams.get("init_from"), saved.module_hparams.get("init_from_sha256")
        if not source or not want:
            raise ValueError("a LoRA checkpoint must name its base (init_from) and the base's checksum "
                             f"(init_from_sha256); this one has init_from={source!r}, init_from_sha256={want!r}")
        base = cls.read_pretrained(source)
        digest = state_digest(base.state_dict)
        if digest != want:
            raise ValueError(f"the LoRA checkpoint's base init_from={source!r} has changed: its weights have sha256 "
                             f"{digest}, the adapters were trained on {want}; restore that base model there")
        return dataclasses.replace(saved, state_dict=merged_state_dict({**base.state_dict, **saved.state_dict}, lora))

    @classmethod
    @override
    def checkpoint_arguments(cls, saved: SavedModel, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """As the base; a checkpoint whose run read the vocabulary from its datamodule (``vocab_size: None``)
        gets the embedding's rows (unpadded in checkpoints), a LoRA checkpoint (no embedding) its base's."""
        hparams = super().checkpoint_arguments(saved, overrides)
        if hparams.get("lora") is not None:  # the checkpoint holds the adapters: the base is init_from's, checked
            hparams["init_from"] = saved.module_hparams.get("init_from")
        config = hparams[CONFIG_HPARAM]
        if isinstance(config, Mapping) and config.get("vocab_size") is None:
            embedding = saved.state_dict.get("embedding.word_embeddings.weight")
            if embedding is not None:
                vocab = embedding.size(0)
            elif hparams.get("lora") is not None and hparams.get("init_from"):  # adapters only: the base's vocabulary
                source = str(hparams["init_from"])
                vocab = cls.read_architecture(source).get("vocab_size")
                if vocab is None:  # a base of ours whose run read it from its datamodule: its embedding's rows
                    from lightning_megatron.saved_model import saved_shape

                    rows = saved_shape(source, "embedding.word_embeddings.weight")
                    vocab = rows[0] if rows else None
            else:
                vocab = None
            hparams[CONFIG_HPARAM] = {**config, "vocab_size": vocab}
        return hparams
