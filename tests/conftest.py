"""Shared fixtures: every test leaves environment variables, default dtype, seeds and process groups as it found them."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # so spawned ranks can import tests' helpers


@pytest.fixture(autouse=True)
def _restore_global_state():
    env = dict(os.environ)
    dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    yield
    os.environ.clear()
    os.environ.update(env)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
