"""ModuleSpec: a model described as data, built by :func:`build_module`, and a registry of named specs.

A spec reads like the architecture diagram (Megatron's ``spec_utils.py``)::

    ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=LayerNorm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.padding},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, ...)),
        ...))

``build_module(spec, *args, **kwargs)`` instantiates ``spec.module(*args, **spec.params, **kwargs,
submodules=spec.submodules)``. A bare class is instantiated with ``*args, **kwargs``; a bare function
(``get_bias_dropout_add``) is returned as is. Any error raised while building is re-raised with the
name of the module being built, so a failure deep inside a spec says where it happened.

Recipes refer to specs by name: :func:`register_spec` adds one (users register their own the same
way), :func:`get_spec` looks one up, :func:`list_specs` lists them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModuleSpec", "build_module", "register_spec", "get_spec", "list_specs"]


@dataclass(kw_only=True)
class ModuleSpec:
    """What to build: a module class (or function), extra constructor params, and its submodule specs."""

    module: type | Callable[..., Any]
    """The class to instantiate (or a function, returned as is)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the constructor on top of the caller's."""
    submodules: Any = None
    """A ``*Submodules`` dataclass of child specs, passed as ``submodules=``; None passes nothing."""


def _name(spec: ModuleSpec | type | Callable[..., Any]) -> str:
    target = spec.module if isinstance(spec, ModuleSpec) else spec
    return getattr(target, "__qualname__", None) or repr(target)


def build_module(spec: ModuleSpec | type | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Instantiate ``spec`` (see the module docstring). Errors name the module being built."""
    target = spec.module if isinstance(spec, ModuleSpec) else spec
    # Functions (bias-dropout-add) are used as they are, not called at build time.
    if isinstance(target, (types.FunctionType, types.BuiltinFunctionType)):
        return target
    if not isinstance(target, type):
        raise TypeError(f"build_module: expected a ModuleSpec, a class or a function, got {target!r}")
    if isinstance(spec, ModuleSpec):
        kwargs = {**spec.params, **kwargs}
        if spec.submodules is not None:
            kwargs["submodules"] = spec.submodules
    try:
        return target(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with context, same type when possible
        message = f"{e} (while building {_name(spec)})"
        try:
            wrapped = type(e)(message)
        except Exception:  # noqa: BLE001 - exception types with unusual constructors
            raise RuntimeError(message) from e
        raise wrapped.with_traceback(e.__traceback__) from e


_REGISTRY: dict[str, ModuleSpec] = {}


_BUILT_IN: set[str] = set()
"""The names lightning_megatron's model families register (:func:`register_built_in_spec`)."""


def register_spec(name: str, spec: ModuleSpec, *, overwrite: bool = False) -> ModuleSpec:
    """Register ``spec`` under ``name`` so recipes can say ``spec: name``. Returns ``spec``.

    Raises ``ValueError`` when ``name`` is taken, unless ``overwrite=True``; a built-in name (``gpt_layer_spec``,
    ``bert_layer_local_spec``, ...) is never replaced: export, import and ``check`` read a checkpoint's spec name
    as that architecture, so a model built from another spec under it would export as the built-in one, its own
    parts left out or computed differently.
    """
    if not isinstance(spec, ModuleSpec):
        raise TypeError(f"register_spec({name!r}): expected a ModuleSpec, got {type(spec).__name__}")
    if name in _BUILT_IN:
        raise ValueError(f"spec {name!r} is built in: export, import and check read a checkpoint's spec name as that "
                         f"architecture, so it is never replaced; register yours under a name of its own "
                         f"(register_spec('my_{name}', ...)) and set the model config's spec to it")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"spec {name!r} is already registered; choose another name or pass overwrite=True")
    _REGISTRY[name] = spec
    return spec


def register_built_in_spec(name: str, spec: ModuleSpec) -> ModuleSpec:
    """:func:`register_spec` for the specs of lightning_megatron's own model families: their names are kept."""
    register_spec(name, spec)
    _BUILT_IN.add(name)
    return spec


def get_spec(name: str) -> ModuleSpec:
    """The spec registered under ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown spec {name!r}; registered specs: {sorted(_REGISTRY)} "
                         f"(register yours with lightning_megatron.transformer.register_spec)") from None


def list_specs() -> list[str]:
    """Names of all registered specs, sorted."""
    return sorted(_REGISTRY)
