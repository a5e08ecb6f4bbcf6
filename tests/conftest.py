"""Shared fixtures: every test leaves environment variables, default dtype, seeds, process groups and W&B's run as
it found them.

The device the tests run on: ``pytest --device cuda`` (or ``LM_TEST_DEVICE=cuda``; default cpu).
On cuda, single-rank tests create their tensors on the GPU (``torch.set_default_device``) and
Trainers use ``accelerator="gpu"``; multi-rank tests (tests/dist_utils.py) run on NCCL with one GPU
per rank, and are skipped, with the reason, when there are fewer GPUs than ranks.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # so spawned ranks can import tests' helpers

from dist_utils import DEVICE_ENV, test_device  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=None, choices=["cpu", "cuda"],
                     help=f"device the tests run on (default: ${DEVICE_ENV} or cpu)")


def pytest_configure(config: pytest.Config) -> None:
    device = config.getoption("--device")
    if device is not None:
        os.environ[DEVICE_ENV] = device  # spawned ranks inherit it
    if test_device() == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda (or LM_TEST_DEVICE=cuda) was asked for, but torch sees no GPU")
    if hasattr(config.option, "loadscopereorder"):  # xdist orders the modules by their number of tests unless
        config.option.loadscopereorder = False       # told not to: the order above is the one that balances
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # pytest -n N: this is one of N workers
    if workers > 1:  # the cores shared between the workers, not each worker's threads spinning on all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


SLOW_MODULES_FIRST = (
    "test_cli_recipes.py", "test_cli_refusals.py", "test_check.py", "test_lora.py", "test_cli_run_folder.py",
    "test_gpt_parallel.py", "test_docs_blocks.py", "test_docs_finetune.py", "test_strategy_checkpoint.py",
    "test_moe_cli.py", "test_reliability_sigterm.py", "test_context_parallel.py", "test_wandb_init_bound.py",
    "test_cpu_shared_memory.py", "test_estimate.py", "test_distributed_optimizer_fit.py", "test_strategy_parity.py",
    "test_launch.py", "test_lm_eval.py", "test_gpt_predict.py", "test_custom_module.py", "test_base_install.py",
)
"""The modules that take longest, longest first (each module's summed ``pytest --durations=0``, 2026-12-08, AMD EPYC
host: 90 s down to 16 s of the suite's 1210 s), run first: with ``-n 2 --dist loadscope`` (the README's
command) a worker that takes one of them last would finish alone, minutes after the other."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: every module keeps its order


def pytest_report_header(config: pytest.Config) -> str:
    return f"lightning_megatron test device: {test_device()}"


@pytest.fixture
def device() -> torch.device:
    """The test device (cpu, or the first GPU with ``--device cuda``)."""
    return torch.device("cuda", 0) if test_device() == "cuda" else torch.device("cpu")


def _indices_on_the_host(sampler_iter):
    """A sampler's ``__iter__`` run on the host: torch's samplers draw with a CPU generator, which the GPU
    default device (this harness's way of putting single-rank tests on the GPU) would refuse. The indices are
    drawn at once (a mode left pushed across a generator's yields would leak into the consumer)."""
    def iter_on_host(self):
        with torch.device("cpu"):
            return iter(list(sampler_iter(self)))
    return iter_on_host


@pytest.fixture(autouse=True)
def _restore_global_state(monkeypatch):
    env = dict(os.environ)
    dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    on_gpu = test_device() == "cuda"
    if on_gpu:
        torch.set_default_device("cuda")
        from torch.utils.data import DistributedSampler, RandomSampler

        for sampler in (DistributedSampler, RandomSampler):
            monkeypatch.setattr(sampler, "__iter__", _indices_on_the_host(sampler.__iter__))
    yield
    if on_gpu:
        torch.set_default_device(None)
    os.environ.clear()
    os.environ.update(env)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.run.finish()  # a run a failed test left going: the next WandbLogger would reuse it
