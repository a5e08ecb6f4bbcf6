"""Decoder generation as users expect it (``GPTLightningModule.generate``, :mod:`lightning_megatron.generation`).

- Prompts of different lengths in one batch (left padding): greedy tokens equal each prompt generated alone
  (the unpadded path), for the GPT-2 shape (learned positions: each row's positions must start at its first
  real token) and the Llama shape (RoPE, grouped-query attention), with and without the KV cache, as a list
  or as a padded tensor with its attention mask; and equal to transformers' ``LlamaForCausalLM.generate`` on
  the same left-padded batch and weights (imported from its folder), with and without an end token.
- One stop rule (:class:`~lightning_megatron.generation.StopRule`) for Python and ``predict``: the
  tokenizer's end-of-document token by default (from ``tokenizer=`` or the datamodule's tokenizer), refused by
  name when there is none; stop strings end a sequence and the completion is cut before them.
- Checks before any forward: ``max_new_tokens``, the context length, left padding.
- One 2-process spawn: PP=2 (GPT-2 and Llama shapes), PP=2 x VP=2 and TP=2 with sequence parallelism generate
  one process's tokens (left-padded lists, a stop token), and ``Trainer.predict`` at PP=2 writes them too.

The weights are drawn with std 0.3: at 0.02 the tied GPT-2 shape repeats the last token whatever the
positions and masks, and the equalities would prove nothing (checked: without the padding mask, or with
the positions counted from the padding, the GPT-2 rows differ).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_megatron.generation import StopRule, generate
from lightning_megatron.models.gpt import GPTConfig
from lightning_megatron.models.gpt.module import GPTLightningModule
from lightning_megatron.parallel_dims import ParallelDims

VOCAB, MAX_SEQ, NEW = 64, 24, 8
GPT2 = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
            max_sequence_length=MAX_SEQ, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3,
            activation="gelu_tanh")
LLAMA = {**GPT2, "spec": "llama_layer_spec", "num_query_groups": 2, "activation": "silu", "gated_linear_unit": True,
         "add_bias_linear": False, "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True}
SHAPES = {"gpt2": GPT2, "llama": LLAMA}


def _module(shape: str, **kwargs) -> GPTLightningModule:
    return GPTLightningModule(GPTConfig(**SHAPES[shape]), **kwargs)


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 9, 5)]


class WordTokenizer:
    """Token i is the word ``" w<i>"``; ``eod`` as given."""

    def __init__(self, eod: int) -> None:
        self.eod = eod

    def tokenize(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def detokenize(self, ids) -> str:
        return "".join(f" w{i}" for i in ids)


def _alone(module, prompts, n=NEW, **kw):
    return [module.generate(p[None], n, stop_token=None, **kw)[0] for p in prompts]


# ---------------------------------------------------------------- left padding


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_a_left_padded_batch_generates_what_each_prompt_does_alone(shape):
    module = _module(shape)
    module.configure_model()
    prompts = _prompts()
    alone = _alone(module, prompts)
    batch = module.generate(prompts, NEW, stop_token=None)
    assert [row.tolist() for row in batch] == [row.tolist() for row in alone]
    assert [row.tolist() for row in module.generate(prompts, NEW, stop_token=None, use_cache=False)] == \
        [row.tolist() for row in alone]
    # the padded tensor and its attention mask (Hugging Face's layout): the same rows, padding kept
    s0 = max(len(p) for p in prompts)
    tokens = torch.stack([torch.cat([torch.full((s0 - len(p),), 7), p]) for p in prompts])
    mask = torch.stack([torch.arange(s0) >= s0 - len(p) for p in prompts]).long()
    padded = module.generate(tokens, NEW, attention_mask=mask, stop_token=None)
    assert torch.equal(padded[:, :s0], tokens)
    assert [row[s0:].tolist() for row in padded] == [row[len(p):].tolist() for row, p in zip(alone, prompts)]


def test_sampling_with_a_seed_a_prompt_draws_the_same_tokens_in_any_batch():
    """``predict`` sampled from torch's generator, which a resume restores from the checkpoint: no seed changed its
    samples at the checkpoint's layout, and each batch and layout drew others. With ``seeds`` each prompt draws from
    its own generator: alone or in a batch, the same tokens; another seed, others. A temperature whose
    ``logits / T`` overflows fp32 samples the argmax (it raised "probability tensor contains either inf, nan")."""
    module = _module("llama")
    module.configure_model()
    prompts = _prompts()
    kw = dict(stop_token=None, greedy=False, top_k=50)
    batch = module.generate(prompts, NEW, seeds=[11, 12, 13], **kw)
    alone = [module.generate([p], NEW, seeds=[s], **kw)[0] for p, s in zip(prompts, (11, 12, 13))]
    assert [row.tolist() for row in batch] == [row.tolist() for row in alone]
    assert [row.tolist() for row in module.generate(prompts, NEW, seeds=[21, 22, 23], **kw)] != \
        [row.tolist() for row in batch]
    with pytest.raises(ValueError, match="not both"):
        module.generate(prompts, NEW, seeds=[1, 2, 3], generator=torch.Generator(), **kw)
    with pytest.raises(ValueError, match="seeds: 2 for 3 prompts"):
        module.generate(prompts, NEW, seeds=[1, 2], **kw)
    cold = module.generate(prompts, NEW, stop_token=None, greedy=False, temperature=1e-45, seeds=[1, 2, 3])
    assert [row.tolist() for row in cold] == [row.tolist() for row in module.generate(prompts, NEW, stop_token=None)]


def test_a_left_padded_llama_batch_equals_transformers_generate(tmp_path):
    import transformers
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_SEQ, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.3, rope_theta=5000.0, bos_token_id=0, eos_token_id=0)).eval()
    hf.save_pretrained(tmp_path)
    module = GPTLightningModule.from_pretrained(str(tmp_path))
    module.configure_model()
    prompts = _prompts()
    s0 = max(len(p) for p in prompts)
    pad = 1
    tokens = torch.stack([torch.cat([torch.full((s0 - len(p),), pad), p]) for p in prompts])
    mask = torch.stack([torch.arange(s0) >= s0 - len(p) for p in prompts]).long()
    theirs = hf.generate(tokens, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=pad)
    ours = module.generate(tokens, NEW, attention_mask=mask, stop_token=None)
    assert torch.equal(ours, theirs), (ours, theirs)
    # an end token one row reaches early: transformers pads that row with it (pad_token_id = eos), as we do
    stop = int(theirs[1, s0 + 2])
    theirs = hf.generate(tokens, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=stop,
                         pad_token_id=stop)
    ours = module.generate(tokens, NEW, attention_mask=mask, stop_token=stop)
    assert (theirs == stop).any() and torch.equal(ours, theirs), (ours, theirs)


# ---------------------------------------------------------------- the stop rule


def test_stop_rule_ends_at_the_token_or_the_string_and_cuts_the_text_before_it():
    words = ["a", "b", "\n", "\n\n", "c", "<eod>"]

    def detokenize(ids):
        return "".join(words[i] for i in ids)

    a, b, nl, nlnl, c, eod = range(6)
    rule = StopRule(stop_token=eod, stop_strings=("\n\n",), detokenize=detokenize)
    assert rule.end([a, b, eod, c]) == 3 and rule.completion([a, b, eod, c, c]) == "ab"
    assert rule.end([a, nl, nl, b, eod]) == 3 and rule.completion([a, nl, nl, b]) == "a"  # "\n\n" over two tokens
    assert rule.end([a, nlnl, b]) == 2 and rule.completion([a, nlnl, b]) == "a"
    assert rule.end([a, b, c]) == 3 and rule.completion([a, b, c]) == "abc"
    assert StopRule(stop_strings=["b\n"], detokenize=detokenize).completion([a, b, nlnl, c]) == "a"
    with pytest.raises(ValueError, match="need the text.*detokenize"):
        StopRule(stop_strings=("\n",))
    for bad in ("\n", [""], [3]):
        with pytest.raises(ValueError, match="must be a list of non-empty strings"):
            StopRule(stop_strings=bad, detokenize=detokenize)
    with pytest.raises(ValueError, match="predict_stop_strings='x' must be a list"):
        _module("gpt2", predict_stop_strings="x")


def test_generate_stops_at_the_tokenizers_eod_by_default_and_at_stop_strings():
    module = _module("llama")
    module.configure_model()
    prompts = _prompts()
    alone = [row[len(p):].tolist() for row, p in zip(_alone(module, prompts), prompts)]
    # No tokenizer and no datamodule: refused, naming the fixes, before anything runs.
    with pytest.raises(ValueError, match=r"stop_token='eod'.*no datamodule is attached.*tokenizer=.*stop_token=None"):
        module.generate(prompts, NEW)
    with pytest.raises(ValueError, match=r"stop_strings=\[' w1'\].*tokenizer="):
        module.generate(prompts, NEW, stop_token=None, stop_strings=[" w1"])
    with pytest.raises(TypeError, match="eod.*detokenize"):
        module.generate(prompts, NEW, tokenizer=object())
    # The datamodule's tokenizer (any datamodule with one): its eod ends row 1 after its 3rd token.
    eod = alone[1][2]
    module.trainer = SimpleNamespace(datamodule=SimpleNamespace(tokenizer=WordTokenizer(eod)))
    stopped = module.generate(prompts, NEW)
    for p, row, want in zip(prompts, stopped, alone):
        end = want.index(eod) + 1 if eod in want else NEW
        assert row[len(p):].tolist() == want[:end]
    pair = [prompts[1], prompts[1].flip(0)]  # as a tensor: an ended row is padded with eod
    for row, ragged in zip(module.generate(torch.stack(pair), NEW), module.generate(pair, NEW)):
        new = ragged[9:].tolist()
        assert row[9:].tolist() == new + [eod] * (len(row) - 9 - len(new))
    # tokenizer= wins over the datamodule's; a stop string ends a row at the token that completes it
    tokenizer = WordTokenizer(eod=VOCAB - 1)
    t0, t1, t2 = alone[1][:3]
    stop = f"w{t1} w{t2}"  # spans row 1's 2nd and 3rd new tokens
    assert stop not in tokenizer.detokenize(alone[1][:2])
    out = module.generate(prompts, NEW, tokenizer=tokenizer, stop_token=None, stop_strings=[stop])
    assert out[1][len(prompts[1]):].tolist() == alone[1][:3]
    completions = module.complete([tokenizer.detokenize(p.tolist()) for p in prompts], NEW,
                                  tokenizer=tokenizer, stop_token=None, stop_strings=[stop])
    assert completions[1] == f" w{t0} "


# ---------------------------------------------------------------- checks before any forward


def test_settings_and_context_length_are_refused_before_any_forward():
    def forward(*args):
        raise AssertionError("no forward may run")

    prompt = torch.zeros(1, 7, dtype=torch.int64)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=f"max_new_tokens={bad!r} must be an integer >= 0"):
            generate(forward, prompt, bad)
    with pytest.raises(ValueError, match=r"a prompt of 7 tokens followed by max_new_tokens=20 needs 26 positions, "
                                         r"more than the model's max_sequence_length=24; generate at most 18 new "
                                         r"tokens \(max_new_tokens=18\) or shorten the prompt to at most 5 tokens"):
        generate(forward, prompt, 20, max_sequence_length=24)
    with pytest.raises(ValueError, match="left-padded prompts"):
        generate(forward, torch.zeros(2, 3, dtype=torch.int64), 2, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert generate(forward, prompt, 0).shape == (1, 7)  # nothing to generate: no forward
    module = _module("gpt2")
    module.configure_model()
    with pytest.raises(ValueError, match="the longest prompt: a prompt of 9 tokens.*max_sequence_length=24"):
        module.generate(_prompts(), 17, stop_token=None)
    assert len(module.generate(_prompts(), 16, stop_token=None)[1]) == 9 + 16  # 24 positions seen: fits


# ---------------------------------------------------------------- PP and SP (one 2-process spawn)


LAYOUTS = {"pp2-gpt2": ("gpt2", ParallelDims(pp=2)), "pp2": ("llama", ParallelDims(pp=2)),
           "pp2vp2": ("llama", ParallelDims(pp=2, vp=2)),
           "tp2sp": ("llama", ParallelDims(tp=2, sequence_parallel=True))}


SAMPLED = dict(greedy=False, top_k=50, temperature=0.8, seeds=[11, 12, 13])
"""Sampling with a seed a prompt: the same tokens at every layout."""


def _reference() -> dict:
    out = {}
    for shape in ("gpt2", "llama"):
        module = _module(shape)
        module.configure_model()
        out[shape] = module.generate(_prompts(), NEW, stop_token=None)
        out[f"{shape}-sampled"] = module.generate(_prompts(), NEW, stop_token=None, **SAMPLED)
    return out


def _layouts_worker(stops: dict) -> dict:
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from dist_utils import accelerator
    from lightning_megatron.parallel_state import initialize_model_parallel
    from lightning_megatron.strategy import MegatronStrategy

    out = {}
    for name, (shape, dims) in LAYOUTS.items():
        module = _module(shape)
        module.connect_parallel_state(initialize_model_parallel(dims))
        module.configure_model()
        out[name] = {"padded": module.generate(_prompts(), NEW, stop_token=None),
                     "stopped": module.generate(_prompts(), NEW, stop_token=stops[shape]),
                     "sampled": module.generate(_prompts(), NEW, stop_token=None, **SAMPLED),
                     "sequence_parallel_after": module.config.sequence_parallel}  # switched off while generating only
    # predict through the strategy at PP=2 (the CLI's path): every stage generates, the last one returns
    module = _module("llama", predict_max_new_tokens=NEW, predict_stop_at_eod=False)
    trainer = Trainer(accelerator=accelerator(), devices=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      strategy=MegatronStrategy(pipeline_model_parallel_size=2, micro_batch_size=1))
    rows = [{"tokens": p} for p in torch.stack([_prompts()[1], _prompts()[1].flip(0)])]
    out["predict-pp2"] = trainer.predict(module, DataLoader(rows, batch_size=2))[0]
    return out


def test_pipeline_and_sequence_parallel_layouts_generate_one_process_tokens():
    from dist_utils import run_distributed

    reference = _reference()
    stops = {shape: int(reference[shape][1][9 + 2]) for shape in ("gpt2", "llama")}  # row 1 ends after 3 tokens
    ranks = run_distributed(_layouts_worker, 2, stops, timeout=240)
    for name, (shape, _) in LAYOUTS.items():
        want = [row.tolist() for row in reference[shape]]
        stopped = [w[: len(p) + w[len(p):].index(stops[shape]) + 1] if stops[shape] in w[len(p):] else w
                   for w, p in zip(want, _prompts())]
        for rank, out in enumerate(ranks):
            assert out[name]["sequence_parallel_after"] == LAYOUTS[name][1].sequence_parallel
            assert [row.tolist() for row in out[name]["padded"]] == want, (name, rank)
            assert [row.tolist() for row in out[name]["stopped"]] == stopped, (name, rank)
            assert [row.tolist() for row in out[name]["sampled"]] == \
                [row.tolist() for row in reference[f"{shape}-sampled"]], (name, rank)
    module = _module("llama")
    module.configure_model()
    prompts = torch.stack([_prompts()[1], _prompts()[1].flip(0)])
    assert torch.equal(ranks[1]["predict-pp2"], module.generate(prompts, NEW, stop_token=None))
