"""LanguageModelConfig: what every language model's configuration holds beyond a TransformerConfig.

A model family's record extends it (``BertConfig``, ``GPTConfig``) and its LightningModule takes the
record (``BertLightningModule(config=BertConfig(num_layers=12, ...))``; in a recipe, the ``config:``
section under the model's arguments). The record is the one place a field is spelled, typed,
defaulted and documented.

The layout fields of TransformerConfig (``tensor_model_parallel_size``, ``sequence_parallel``) belong
to the strategy: they are ``None`` here and :meth:`LanguageModelConfig.with_layout` fills them in when
the chunks are built, refusing a value given here that disagrees with the strategy's.

No Lightning imports here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lightning_megatron.transformer.config import TransformerConfig, dtype_name

__all__ = ["LanguageModelConfig", "LAYOUT_FIELDS", "ROPE_FIELDS"]

LAYOUT_FIELDS = {"tensor_model_parallel_size": "tensor_model_parallel_size", "sequence_parallel": "sequence_parallel",
                 "expert_model_parallel_size": "expert_model_parallel_size"}
"""The record's fields the strategy sets -> the MegatronStrategy argument a user sets instead."""

_Config = TypeVar("_Config", bound="LanguageModelConfig")

ROPE_FIELDS = ("rotary_base", "rotary_percent", "rope_scaling", "rope_scaling_factor")
"""The rotary embedding's fields: a model without it refuses them set (a rotary_base given to learned positions
trained without a word)."""


@dataclass(kw_only=True)
class LanguageModelConfig(TransformerConfig):
    """A TransformerConfig with the vocabulary, the positions and the layer spec (megatron-core's
    ``LanguageModule`` takes the same besides its config)."""

    num_layers: int = 2
    """Number of transformer layers in the whole model (all pipeline stages together)."""
    hidden_size: int = 128
    """Width h of the residual stream."""
    num_attention_heads: int = 4
    """Number of attention heads n; each TP rank holds n / t whole heads."""
    vocab_size: int | None = None
    """The real vocabulary (the word embedding's rows before padding); None: the datamodule's ``vocab_size``
    (its tokenizer's), read when the model is built."""
    max_sequence_length: int = 128
    """Rows of the learned position embedding; the longest sequence the model takes."""
    spec: str
    """A registered layer spec name (``lightning_megatron.transformer.register_spec``)."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times the TP size (``pad_vocab_size``); the padded
    logit columns never count in the loss."""
    tensor_model_parallel_size: int | None = None
    """The strategy's TP size, filled in when the model is built; set it on the MegatronStrategy
    (``tensor_model_parallel_size``). A value here must equal the strategy's."""
    sequence_parallel: bool | None = None
    """The strategy's ``sequence_parallel``, filled in when the model is built; set it on the MegatronStrategy.
    A value here must equal the strategy's."""
    expert_model_parallel_size: int | None = None
    """The strategy's EP size, filled in when the model is built; set it on the MegatronStrategy
    (``expert_model_parallel_size``). A value here must equal the strategy's."""

    def __post_init__(self) -> None:
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool)
                                            or self.vocab_size < 1):
            raise ValueError(f"vocab_size={self.vocab_size!r} must be a positive integer, or None for the "
                             f"datamodule's")
        for name in ("max_sequence_length", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"spec={self.spec!r} must be the name of a registered layer spec")
        # Until the strategy's layout is known the sizes are validated at TP=1 (with_layout validates
        # the TP-dependent rules again at the strategy's TP size).
        layout = self.tensor_model_parallel_size, self.sequence_parallel, self.expert_model_parallel_size
        self.tensor_model_parallel_size = 1 if layout[0] is None else layout[0]
        self.sequence_parallel = bool(layout[1]) if layout[0] is not None else False
        self.expert_model_parallel_size = 1 if layout[2] is None else layout[2]
        try:
            super().__post_init__()
        finally:
            self.tensor_model_parallel_size, self.sequence_parallel, self.expert_model_parallel_size = layout

    def _refuse_unused(self, names: tuple[str, ...], why: str) -> None:
        """Refuse the fields of ``names`` set to other than their defaults, which this model would not read
        (``why``: what the model has instead, and the way on)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        unused = [f"{n}={getattr(self, n)!r}" for n in names if getattr(self, n) != defaults[n]]
        if unused:
            raise ValueError(f"{', '.join(unused)} would not be used: {why}")

    def _check_experts(self, moe_spec: str | None) -> None:
        """A mixture-of-experts spec needs ``num_moe_experts``, and ``num_moe_experts`` needs such a spec (a dense
        spec would silently ignore it), as do the ``moe_*`` fields; ``moe_spec``: the family's built-in spec with
        experts, if it has one. The family's specs are registered before."""
        from lightning_megatron.transformer import get_spec
        from lightning_megatron.transformer.moe import MoELayer

        mlp = getattr(get_spec(self.spec).submodules, "mlp", None)
        has_experts = getattr(mlp, "module", None) is MoELayer
        if has_experts and not self.num_moe_experts:
            raise ValueError(f"spec={self.spec!r} has a mixture of experts: set num_moe_experts (e.g. 8)")
        if not self.num_moe_experts:
            self._refuse_unused(tuple(f.name for f in dataclasses.fields(self) if f.name.startswith("moe_")),
                                "num_moe_experts is not set, so the model has no experts: set it (with a spec whose "
                                "MLP is transformer.moe.MoELayer), or drop them")
        if self.num_moe_experts and not has_experts:
            use = f"spec: {moe_spec} (or a spec" if moe_spec else "a spec of your own (register_spec)"
            raise ValueError(f"num_moe_experts={self.num_moe_experts} but spec={self.spec!r} has a dense MLP; use "
                             f"{use} whose MLP slot is transformer.moe.MoELayer{')' if moe_spec else ''}")

    @classmethod
    def coerce(cls: type[_Config], value: _Config | Mapping[str, Any] | None) -> _Config:
        """``value`` as a record of its own (a copy: a default record is never shared): None is the defaults,
        a mapping its fields (saved hyper-parameters, a recipe's ``config:`` section read as YAML); a field
        this record does not have is refused."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return dataclasses.replace(value)
        if isinstance(value, LanguageModelConfig):
            raise TypeError(f"a {cls.__name__} is needed here, not a {type(value).__name__}")
        if not isinstance(value, Mapping):
            raise TypeError(f"config={value!r}: a {cls.__name__} or a mapping of its fields is needed")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}; its fields: "
                             f"{', '.join(sorted(names))}")
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        """Every field as a plain value (the dtype by name): what a checkpoint's hyper-parameters hold,
        and ``coerce`` takes back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        if isinstance(out["params_dtype"], torch.dtype):
            out["params_dtype"] = dtype_name(out["params_dtype"])
        return out

    def with_layout(self: _Config, tensor_model_parallel_size: int, sequence_parallel: bool,
                    expert_model_parallel_size: int = 1) -> _Config:
        """This record at the strategy's layout (the TP- and EP-dependent rules validated at those sizes);
        refuses a layout field given here that disagrees with the strategy's."""
        given = {"tensor_model_parallel_size": self.tensor_model_parallel_size, "sequence_parallel": self.sequence_parallel,
                 "expert_model_parallel_size": self.expert_model_parallel_size}
        actual = {"tensor_model_parallel_size": tensor_model_parallel_size, "sequence_parallel": sequence_parallel,
                  "expert_model_parallel_size": expert_model_parallel_size}
        for name, value in given.items():
            if value is not None and value != actual[name]:
                raise ValueError(
                    f"config.{name}={value!r} but the strategy runs {name}={actual[name]!r}: the layout is the "
                    f"strategy's: set MegatronStrategy({LAYOUT_FIELDS[name]}=...) (--trainer.strategy.init_args."
                    f"{LAYOUT_FIELDS[name]}) and leave config.{name} unset (null)")
        return dataclasses.replace(self, **actual)
