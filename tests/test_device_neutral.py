"""One code path for every device: no "cuda" literal in the package, no CPU-only branch outside
lightning_megatron/cpu/ (the opt-in CPU tuning) but the one correction of torch's CPU kernels' 16-bit sums, the
tuning off by default, and on a GPU a training step without host synchronisation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import lightning_megatron
from dist_utils import test_device
from lightning_megatron.parallel_dims import ParallelDims

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


KERNEL_CORRECTION = {PACKAGE / "tensor_parallel" / "utils.py": 1}
"""Where the library corrects a torch CPU kernel's numbers (not a tuning, so not opt-in), and how many CPU branches:
``kernel_sums_in_16_bits``, which 16-bit weight gradients the library sums in fp32 because torch's CPU kernels
sum them in 16 bits (``tests/test_wide_sums.py``)."""


def test_no_cpu_only_branch_outside_the_cpu_package():
    hits = [f"{f.relative_to(PACKAGE.parent)}:{i}: {line.strip()}" for f in _sources() if CPU_PACKAGE not in f.parents
            for i, line in enumerate(f.read_text().splitlines(), 1) if CPU_BRANCH.search(line)
            and f not in KERNEL_CORRECTION]
    assert not hits, "CPU-specific code belongs in lightning_megatron/cpu/ (opt-in):\n" + "\n".join(hits)
    for f, count in KERNEL_CORRECTION.items():  # the corrections stay where they are named, as few as they are
        assert sum(bool(CPU_BRANCH.search(line)) for line in f.read_text().splitlines()) == count, f


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
    from lightning_megatron.datamodules.pretraining import NO_PADDING, BertDataModule
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.tensor_parallel import model_parallel_seed
    from megatron_testing import TINY_CONFIG, TINY_OPTIONS, SyntheticBertDataset

    model_parallel_seed(1234, 0)
    # lm_head_on_masked_only selects the masked tokens by a boolean mask (a data-dependent shape,
    # one sync per microbatch; docs/strategy.md lists it): off here.
    module = BertLightningModule({**TINY_CONFIG, "hidden_dropout": 0.1, "attention_dropout": 0.1}, **TINY_OPTIONS,
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
    from lightning_megatron.communicator import Communicator, TorchCommunicator
    from lightning_megatron.cpu.shared_memory import SharedMemoryCollectives
    from lightning_megatron.parallel_state import ParallelState

    assert isinstance(TorchCommunicator(None), Communicator)
    assert all(hasattr(SharedMemoryCollectives, m) for m in ("all_reduce", "all_gather_into_tensor",
                                                              "reduce_scatter_tensor", "close"))
    ps = ParallelState.single_process()
    with pytest.raises(ValueError, match="no 'tp' group"):
        ps.set_communicator("tp", TorchCommunicator(None))
    with pytest.raises(ValueError, match="unknown group name 'xx'"):
        ps.group("xx")
    ps.close_communicators()  # nothing installed: nothing to do
    assert ps.communicators == {}


class _Recording:
    """A communicator that records its calls and answers as a two-rank group would (no torch)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closed = False

    def all_reduce(self, tensor, op=None, *, async_op=False):
        self.calls.append("all_reduce")
        tensor.mul_(2)

    def all_gather_into_tensor(self, out, tensor, *, async_op=False):
        self.calls.append("all_gather")
        out.copy_(torch.cat([tensor, tensor]))

    def reduce_scatter_tensor(self, out, tensor, *, async_op=False):
        self.calls.append("reduce_scatter")
        out.copy_(2 * tensor.chunk(2)[0])

    def close(self) -> None:
        self.closed = True


def test_the_communicator_belongs_to_the_group_object_not_to_a_registry():
    """Two ParallelStates over the same torch process group: installing a communicator in one leaves the
    other on torch (a process-wide group -> communicator registry would hand it to both), and the
    mappings and layers run the collectives of the group object they are given."""
    from lightning_megatron.communicator import TorchCommunicator
    from lightning_megatron.parallel_state import ParallelGroup, ParallelState
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from lightning_megatron.tensor_parallel.mappings import all_reduce

    torch_group = object()  # stands for one torch ProcessGroup shared by both states
    dims = ParallelDims(tp=2, dp=1)
    a, b = (ParallelState(dims=dims, rank=0, groups={"tp": ParallelGroup(torch_group, size=2, rank=0)})
            for _ in range(2))
    rec = _Recording()
    a.set_communicator("tp", rec)
    assert a.group("tp").communicator is rec and a.communicators == {"tp": rec}
    assert isinstance(b.group("tp").communicator, TorchCommunicator) and b.communicators == {}
    assert b.tp_group is torch_group and b.group("tp").size == 2 and b.group("tp").rank == 0

    t = torch.ones(3)
    assert all_reduce(t, a.group("tp")) is t and torch.equal(t, torch.full((3,), 2.0))
    torch.manual_seed(0)
    col = ColumnParallelLinear(4, 6, tp_group=a.group("tp"), gather_output=True)
    row = RowParallelLinear(6, 4, tp_group=a.group("tp"), input_is_parallel=False)
    hidden, _ = col(torch.randn(5, 4, requires_grad=True))
    out, _ = row(hidden)
    out.sum().backward()
    # forward: the column layer's gather, the row layer's reduce; backward: the scatter's gather, the copy's reduce
    assert rec.calls == ["all_reduce", "all_gather", "all_reduce", "all_gather", "all_reduce"]

    a.close_communicators()
    assert rec.closed and isinstance(a.group("tp").communicator, TorchCommunicator) and a.communicators == {}


def test_a_training_step_reads_the_device_twice():
    """Every read of a device value on the host waits for the accelerator to finish all queued work (and
    starves it while the host catches up). A bf16 BERT step under the strategy (fp32 main params, fused AdamW,
    one process, the library's default path) reads twice: the masked positions (one ``nonzero`` for the LM
    head's rows, before the forward) and, once the update is queued (the found-inf flag skips it on the
    device), the grad norm with the NaN guard's checks of the gradients and the loss. Counted on any device:
    the ops that read (``item``, ``nonzero``, ``masked_select``, ``tolist``) at dispatch."""
    import lightning.pytorch as pl
    from torch.utils._python_dispatch import TorchDispatchMode

    from dist_utils import accelerator
    from lightning_megatron.callbacks import MegatronOptimizerCallback
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.optimizer import OptimizerConfig
    from lightning_megatron.strategy import MegatronStrategy
    from megatron_testing import TINY_CONFIG, TINY_OPTIONS, SyntheticBertDataset

    reads: list[str] = []
    reading = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default}

    indexing = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                torch.ops.aten._index_put_impl_.default}

    class CountReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in reading:
                reads.append(func.overloadpacket.__name__)
            elif func.overloadpacket.__name__.startswith("_fused_adam") and reads[-1:] != ["(the update)"]:
                reads.append("(the update)")  # one kernel per param group
            elif func in indexing and any(i is not None and i.dtype == torch.bool for i in args[1]):
                reads.append(f"{func.overloadpacket.__name__} by a boolean mask")  # a nonzero inside
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        reads.append("tolist")
        return tolist(self)

    class Window(pl.Callback):  # the steps after the first (which allocates the optimizer state)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx >= 1:
                self.mode = CountReads().__enter__()
                torch.Tensor.tolist = counted_tolist

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= 1:
                torch.Tensor.tolist = tolist
                self.mode.__exit__(None, None, None)

    module = BertLightningModule({**TINY_CONFIG, "params_dtype": "bfloat16"}, **TINY_OPTIONS)
    data = torch.utils.data.DataLoader(SyntheticBertDataset(12), batch_size=4)
    trainer = pl.Trainer(accelerator=accelerator(), devices=1, max_steps=3, precision="bf16-true", logger=False,
                         strategy=MegatronStrategy(micro_batch_size=4), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[Window(), MegatronOptimizerCallback(OptimizerConfig())])
    try:
        trainer.fit(module, data)
    finally:
        torch.Tensor.tolist = tolist
    assert reads == ["nonzero", "(the update)", "tolist"] * 2, " | ".join(reads)
