"""``check_layouts`` catches a broken tensor-parallel layer and names its parameter; the same custom
spec, unbroken, passes. The spec is registered here, as a user would register theirs."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from megatron_testing import TINY_MODEL, SyntheticBertDataset

from lightning_megatron.models.bert.specs import bert_layer_spec
from lightning_megatron.tensor_parallel import RowParallelLinear
from lightning_megatron.transformer import LayerNorm, ModuleSpec, get_spec, list_specs, register_spec


class IntactRowParallelLinear(RowParallelLinear):
    """A user's own row-parallel layer: the library's, unchanged."""


class ForgetfulRowParallelLinear(RowParallelLinear):
    """The bug users write: the partial products of the TP ranks are never all-reduced."""

    def forward(self, input_: torch.Tensor):
        output = torch.nn.functional.linear(input_, self.weight)  # input is already TP-parallel
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None


def _spec_with_fc2(fc2: type) -> ModuleSpec:
    layer = bert_layer_spec(LayerNorm, "pre")
    mlp = layer.submodules.mlp
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc2=fc2))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


for _name, _fc2 in (("check_test_intact_fc2", IntactRowParallelLinear),
                    ("check_test_forgetful_fc2", ForgetfulRowParallelLinear)):
    if _name not in list_specs():  # registered once per process (spawned ranks import this module too)
        register_spec(_name, _spec_with_fc2(_fc2))


def make_module(spec: str):
    from lightning_megatron.models.bert.module import BertLightningModule

    return BertLightningModule(**{**TINY_MODEL, "spec": spec})


def _check(spec: str, **kwargs):
    from lightning_megatron.check import check_layouts

    return check_layouts(functools.partial(make_module, spec), functools.partial(SyntheticBertDataset, 64),
                         layouts=["tp2"], global_batch_size=8, micro_batch_size=4, steps=2, timeout=300, **kwargs)


def test_check_names_the_layer_that_forgets_its_all_reduce():
    assert get_spec("check_test_forgetful_fc2").submodules.mlp.submodules.linear_fc2 is ForgetfulRowParallelLinear
    intact = _check("check_test_intact_fc2")
    print(intact.table())
    assert intact.passed, intact.table()
    # At TP=1 the forgetful layer is the intact one (nothing to reduce): the same reference.
    broken = _check("check_test_forgetful_fc2", reference_run=intact.reference)
    print(broken.table())
    assert not broken.passed
    [result] = broken.results
    assert result.worst_param is not None and "mlp.linear_fc2" in result.worst_param, broken.table()
    assert any("linear_fc2" in f for f in result.failures), result.failures
    assert "FAIL" in broken.table().splitlines()[-1]
