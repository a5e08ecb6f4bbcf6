"""The two declared contracts (lightning_megatron/protocols.py), checked once at set-up: what passes,
what is adapted, and the errors that name what is missing."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from megatron_testing import TINY_MODEL


def _bert():
    from lightning_megatron.models.bert.module import BertLightningModule

    module = BertLightningModule(**TINY_MODEL)
    module.configure_model()
    return module


class _Plain(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.fc(batch).sum()


class _Partial(_Plain):
    def forward_step(self, microbatch, chunk):
        return self.fc(microbatch), None


def test_module_contract_accepts_adapts_and_names_what_is_missing():
    from lightning_megatron.protocols import LightningStepsModule, MegatronModule, megatron_module

    bert = _bert()
    assert isinstance(bert, MegatronModule) and megatron_module(bert, pipelined=True, num_chunks=1) is bert
    plain = _Plain()
    adapted = megatron_module(plain, pipelined=False, num_chunks=1)
    assert isinstance(adapted, LightningStepsModule) and list(adapted.model_chunks) == [plain]
    assert [n for n, _ in adapted.sharded_named_parameters()] == ["fc.weight", "fc.bias"]
    with pytest.raises(TypeError, match="pipeline_model_parallel_size > 1 needs it\\); missing: model_chunks, "
                                        "forward_step, pipeline_tensor_shape, sharded_named_parameters"):
        megatron_module(plain, pipelined=True, num_chunks=1)
    with pytest.raises(TypeError, match="implements part of it\\); missing: model_chunks, pipeline_tensor_shape, "
                                        "sharded_named_parameters"):
        megatron_module(_Partial(), pipelined=False, num_chunks=1)
    with pytest.raises(ValueError, match="built 1 model chunk\\(s\\) but the layout needs 2"):
        megatron_module(bert, pipelined=True, num_chunks=2)


def test_overriding_a_step_hook_of_a_forward_step_module_warns():
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.protocols import megatron_module

    class Mine(BertLightningModule):
        def training_step(self, batch, batch_idx):  # never called under the strategy
            return super().training_step(batch, batch_idx)

    module = Mine(**TINY_MODEL)
    module.configure_model()
    with pytest.warns(UserWarning, match="Mine overrides training_step, which the MegatronStrategy does not call"):
        megatron_module(module, pipelined=False, num_chunks=1)
    # BERT's own steps (single device) and the classifier's inherited ones are not overrides of forward_step
    from lightning_megatron.models.bert.classification import BertClassificationModule

    for cls in (BertLightningModule, BertClassificationModule):
        module = cls(**TINY_MODEL)
        module.configure_model()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            megatron_module(module, pipelined=False, num_chunks=1)


def test_optimizer_contract_wraps_plain_torch_and_names_what_is_missing():
    from lightning_megatron.optimizer import Float16OptimizerWithFloat16Params
    from lightning_megatron.protocols import OptimizerWrapper, PlainOptimizer, is_sharded, optimizer_wrapper

    w = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    plain = torch.optim.SGD([w], lr=0.1)
    adapted = optimizer_wrapper(plain)
    assert isinstance(adapted, PlainOptimizer) and adapted.optimizer is plain and adapted.main_param(w) is w
    assert not is_sharded(adapted) and adapted.scale_loss(torch.tensor(3.0)) == 3.0
    mixed = Float16OptimizerWithFloat16Params(torch.optim.SGD([w], lr=0.1))
    assert optimizer_wrapper(mixed) is mixed and isinstance(mixed, OptimizerWrapper)
    main = mixed.main_param(w)
    assert main is mixed.optimizer.param_groups[0]["params"][0] and main.dtype == torch.float32
    with pytest.raises(TypeError, match="neither a torch.optim.Optimizer nor .*; missing: optimizer, grad_scaler, "
                                        "num_skipped_steps, reduces_gradients, last_step_skipped, last_grad_norm, "
                                        "scale_loss, main_param"):
        optimizer_wrapper(object())


class HostAdam(torch.optim.Optimizer):
    """A wrapper of one's own, written from lightning_megatron.protocols.OptimizerWrapper alone (no
    subclass of MegatronOptimizer): fp32 master weights and Adam state kept on the host, the gradients
    read from the strategy's grad buffer, the updated weights copied back into the model."""

    grad_scaler = None
    num_skipped_steps = 0
    reduces_gradients = False
    last_step_skipped = False
    last_grad_norm = None

    def __init__(self, params, grad_buffer, lr=1e-2):
        self.model_params = [p for p in params if p.requires_grad]
        self.masters = {id(p): p.detach().to("cpu", torch.float32).clone() for p in self.model_params}
        self.optimizer = torch.optim.Adam(list(self.masters.values()), lr=lr)
        self.grad_buffer = grad_buffer
        self.param_groups, self.state, self.defaults = self.optimizer.param_groups, self.optimizer.state, {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self.steps = 0

    def scale_loss(self, loss):
        return loss

    def main_param(self, param):
        return self.masters[id(param)]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p in self.model_params:
            self.masters[id(p)].grad = self.grad_buffer.main_grad_of(p).to("cpu")
        self.optimizer.step()
        for p in self.model_params:
            p.copy_(self.masters[id(p)])
        self.steps += 1
        return loss

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


class _HostAdamModule(_Plain):
    def configure_optimizers(self):
        return HostAdam(self.parameters(), self.trainer.strategy.grad_buffer)


class _HalfWrapper(torch.optim.SGD):
    """A torch optimizer with part of the contract: it scales the loss, but says nothing else."""

    def scale_loss(self, loss):
        return loss * 1024.0


def test_a_wrapper_of_ones_own_implements_the_protocol_in_one_file_and_a_partial_one_is_refused():
    """Any class with every OptimizerWrapper member is taken as it is (on main: a torch.optim.Optimizer
    that was not a MegatronOptimizer was silently adapted as plain, its scale_loss and main_param ignored)."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lightning_megatron.protocols import OptimizerWrapper, optimizer_wrapper
    from lightning_megatron.strategy import MegatronStrategy

    module = _HostAdamModule()
    before = module.fc.weight.detach().clone()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(), max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(torch.randn(8, 2), batch_size=4))
    [opt] = trainer.optimizers
    assert isinstance(opt, HostAdam) and isinstance(opt, OptimizerWrapper) and optimizer_wrapper(opt) is opt
    assert opt.steps == 2 and not torch.equal(before, module.fc.weight)
    assert torch.equal(module.fc.weight, opt.main_param(module.fc.weight))
    with pytest.raises(TypeError, match="_HalfWrapper implements part of .*OptimizerWrapper; missing: optimizer, "
                                        "grad_scaler, .*main_param"):
        optimizer_wrapper(_HalfWrapper([nn.Parameter(torch.ones(1))], lr=0.1))


class _NoLossLogged(LightningModule):
    """The whole contract, but a loss function that does not log ``loss``."""

    def configure_model(self) -> None:
        if not hasattr(self, "model_chunks"):
            self.model_chunks = nn.ModuleList([nn.Linear(2, 1)])

    def forward_step(self, microbatch, chunk):
        out = chunk(microbatch).mean()
        return out, lambda output: (output, {"mse": output.detach()})

    def pipeline_tensor_shape(self, microbatch):
        return (1, microbatch.size(0), 2)

    def sharded_named_parameters(self):
        return self.model_chunks.named_parameters()

    def training_step(self, batch, batch_idx):  # required by Lightning; the strategy runs forward_step
        raise NotImplementedError

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_loss_function_without_loss_is_refused_at_the_first_step():
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from dist_utils import accelerator
    from lightning_megatron.strategy import MegatronStrategy

    trainer = Trainer(accelerator=accelerator(), devices=1, strategy=MegatronStrategy(), max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="logged \\['mse'\\] without 'loss'"):
        trainer.fit(_NoLossLogged(), DataLoader(torch.randn(4, 2), batch_size=4))
