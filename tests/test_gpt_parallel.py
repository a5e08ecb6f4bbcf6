"""GPTLightningModule under Trainer.fit at every layout equals one process (fp32, dropout off), through
``lightning_megatron.check.check_layouts`` (the function behind ``lightning-megatron check``).

One reference run (one process) and one 2-rank spawn that fits each layout in turn: TP=2, TP=2 with
sequence parallelism, PP=2 (1F1B), PP=2 x VP=2 (interleaved), DP=2, DP=2 with ZeRO-1. Tolerances are
BERT's (``check.Tolerances()``): per-step loss and grad norm 1e-5 relative, every gradient after
step 1 within 1e-4 of its largest entry, final parameters within 1e-5.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import Dataset

VOCAB, SEQ, GLOBAL_BATCH, MICRO, STEPS = 200, 16, 8, 2, 3

GPT2_TINY = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
                 max_sequence_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh",
                 lr=1e-3, weight_decay=0.01)


class SyntheticGPTDataset(Dataset):
    """Deterministic GPT samples: ``seq + 1`` tokens of an arithmetic progression mod VOCAB (learnable),
    ``tokens`` / ``labels`` shifted by one, and a ``loss_mask`` hiding one target per sample (as an EOD
    would be): the same number of counted tokens in every sample, so any grouping averages alike."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        self.num_samples, self.seed = num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + index)
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        step = int(torch.randint(1, 5, (1,), generator=g))
        seq = (start + step * torch.arange(SEQ + 1)) % VOCAB
        loss_mask = torch.ones(SEQ)
        loss_mask[int(torch.randint(0, SEQ, (1,), generator=g))] = 0.0
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": loss_mask}


def make_module(**overrides):
    from lightning_megatron.models.gpt.module import GPTLightningModule

    return GPTLightningModule(**{**GPT2_TINY, **overrides})


def check(module_factory, layouts: list[str]):
    from lightning_megatron.check import check_layouts

    return check_layouts(module_factory, functools.partial(SyntheticGPTDataset, GLOBAL_BATCH * STEPS),
                         layouts=layouts, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO, steps=STEPS,
                         record_params=True, timeout=600)


GPT2_LAYOUTS = ["tp2", "tp2sp", "pp2", "pp2vp2", "dp2", "dp2zero1"]


@pytest.fixture(scope="module")
def gpt2_report():
    report = check(make_module, GPT2_LAYOUTS)
    print(report.table())
    return report


@pytest.mark.parametrize("layout", GPT2_LAYOUTS)
def test_gpt2_shape_layouts_equal_one_process(gpt2_report, layout):
    """Loss, grad norm, every gradient and the final parameters of the layout within BERT's tolerances."""
    ref = gpt2_report.reference
    [result] = [r for r in gpt2_report.results if r.layout == layout]
    assert result.passed, gpt2_report.table()
    run = gpt2_report.runs[layout]
    # every parameter compared as a global tensor (tied embedding, positions, 4 layers, final norm)
    assert set(run.grads[1]) == set(ref.grads[1]) and len(ref.grads[1]) == 2 + 4 * 12 + 2, sorted(ref.grads[1])
    assert "output_layer.weight" not in ref.grads[1], "tied: the output layer is the word embedding"


def test_gpt2_reference_trained(gpt2_report):
    """The final parameters compared above moved away from the (layout-independent) initial ones: a run
    that never applied its gradients would also "match"."""
    module = make_module()
    module.configure_model()
    init = {n: p.detach()[:VOCAB] if "word_embeddings" in n else p.detach()
            for n, p in module.sharded_named_parameters()}
    final = gpt2_report.reference.params
    assert final.keys() == init.keys()
    matrices = [n for n in final if final[n].dim() == 2]
    moved = [n for n in matrices if (final[n] - init[n]).abs().max() > 1e-3]
    assert moved == matrices, sorted(set(matrices) - set(moved))
