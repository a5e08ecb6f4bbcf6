"""One code path for every device: no "cuda" literal in the package, no CPU-only branch outside
lightning_megatron/cpu/ (the opt-in CPU tuning), the tuning off by default, and on a GPU a training
step without host synchronisation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import lightning_megatron
from dist_utils import test_device

PACKAGE = Path(lightning_megatron.__file__).parent
CPU_PACKAGE = PACKAGE / "cpu"
# Branches on "is this tensor/device a CPU": device.type == "cpu", .is_cpu, device == torch.device("cpu").
CPU_BRANCH = re.compile(r"""\.type\s*[!=]=\s*["']cpu["']|["']cpu["']\s*[!=]=\s*\w+(\.\w+)*\.type\b|\.is_cpu\b|"""
                        r"""[!=]=\s*torch\.device\(\s*["']cpu["']""")


def _sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 40 and any(CPU_PACKAGE in f.parents for f in files)
    return files


def test_no_cuda_literal_in_the_package():
    hits = [f"{f.relative_to(PACKAGE.parent)}:{i}: {line.strip()}" for f in _sources()
            for i, line in enumerate(f.read_text().splitlines(), 1) if "cuda" in line]
    assert not hits, "take the device from a tensor or the strategy, never the literal:\n" + "\n".join(hits)


def test_no_cpu_only_branch_outside_the_cpu_package():
    hits = [f"{f.relative_to(PACKAGE.parent)}:{i}: {line.strip()}" for f in _sources() if CPU_PACKAGE not in f.parents
            for i, line in enumerate(f.read_text().splitlines(), 1) if CPU_BRANCH.search(line)]
    assert not hits, "CPU-specific code belongs in lightning_megatron/cpu/ (opt-in):\n" + "\n".join(hits)


def test_the_pattern_catches_cpu_branches():  # the guard above must be able to fail
    for line in ['if x.device.type == "cpu":', "if t.device.type != 'cpu'", "q.is_cpu and p",
                 'if d == torch.device("cpu"):', 'if "cpu" == x.device.type:']:
        assert CPU_BRANCH.search(line), line
    for line in ['map_location="cpu"', 'state["cpu"] = 1', 'torch.device("cpu") if none else d']:
        assert not CPU_BRANCH.search(line), line


def test_cpu_tuning_is_opt_in():
    from lightning_megatron.cpu import CPUTuning
    from lightning_megatron.strategy import MegatronStrategy

    assert MegatronStrategy().cpu_tuning is None
    assert MegatronStrategy(cpu_tuning=False).cpu_tuning is None
    assert MegatronStrategy(cpu_tuning=True).cpu_tuning == CPUTuning()
    tuning = CPUTuning(keep_freed_memory=False)
    assert MegatronStrategy(cpu_tuning=tuning).cpu_tuning is tuning
    with pytest.raises(TypeError, match="cpu_tuning='yes' must be a lightning_megatron.cpu.CPUTuning"):
        MegatronStrategy(cpu_tuning="yes")
    # On an accelerator the tuning does nothing (no allocator change, no communicators).
    from lightning_megatron.parallel_state import ParallelState

    ps = ParallelState.single_process()
    assert not any(CPUTuning().setup(ps, device=torch.device("meta")).values())
    assert CPUTuning().configure_model(torch.nn.Linear(2, 2), torch.device("meta")) == 0


@pytest.mark.skipif(test_device() != "cuda", reason="needs --device cuda (a GPU): checks that a training step "
                                                    "never synchronizes the host with the GPU")
def test_training_step_without_host_sync():
    from lightning_megatron.data.datamodule import NO_PADDING, BertDataModule
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.tensor_parallel import model_parallel_seed
    from megatron_testing import TINY_MODEL, SyntheticBertDataset

    model_parallel_seed(1234, 0)
    # lm_head_on_masked_only selects the masked tokens by a boolean mask (a data-dependent shape,
    # one sync per microbatch; docs/strategy.md lists it): off here.
    module = BertLightningModule(**{**TINY_MODEL, "hidden_dropout": 0.1, "attention_dropout": 0.1},
                                 lm_head_on_masked_only=False)
    with torch.device("cpu"):  # built on the host as under Lightning, then moved
        module.configure_model()
    chunk = module.model_chunks[0].cuda().train()
    optimizer = module.configure_optimizers()
    data = SyntheticBertDataset(4)
    host = {k: torch.stack([data[i][k].cpu() for i in range(4)]) for k in data[0]}
    batch = BertDataModule().on_before_batch_transfer(host, 0)  # what Lightning calls before the transfer
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    assert NO_PADDING in batch
    for _ in range(2):  # the first step allocates optimizer state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss, loss_func = module.forward_step(batch, chunk)
            loss_func(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


def test_communicator_interface_and_parallel_state_errors():
    from lightning_megatron.cpu.shared_memory import SharedMemoryCollectives
    from lightning_megatron.parallel_state import ParallelState
    from lightning_megatron.tensor_parallel.communicator import Communicator, TorchCommunicator, communicator_of

    assert isinstance(TorchCommunicator(None), Communicator)
    assert all(hasattr(SharedMemoryCollectives, m) for m in ("all_reduce", "all_gather_into_tensor",
                                                              "reduce_scatter_tensor", "close"))
    assert isinstance(communicator_of(None), TorchCommunicator)
    ps = ParallelState.single_process()
    with pytest.raises(ValueError, match="no 'tp' group"):
        ps.set_communicator("tp", TorchCommunicator(None))
    with pytest.raises(ValueError, match="unknown group name 'xx'"):
        ps.group("xx")
    ps.close_communicators()  # nothing installed: nothing to do
    assert ps.communicators == {}
