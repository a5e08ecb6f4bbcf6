"""The GPT family in and out of Hugging Face through our model and the strategy.

- One process: a tiny random ``LlamaForCausalLM`` (grouped-query, SwiGLU, rope base 5000, untied) and
  ``GPT2LMHeadModel`` saved with ``save_pretrained``; ``GPTLightningModule.from_pretrained(folder)`` (the
  architecture read from ``config.json``, as ``--model.init_from``) gives transformers' logits within
  1e-5 (fp32).
- One spawned run of 4 gloo ranks, for both shapes: one training step at TP=2 x PP=2, checkpoint;
  rank 0 exports it (``lightning_megatron.cli.main(["export", "hf", ...])``); for Llama (SwiGLU: the strided
  ``linear_fc1``) every rank then starts a new module from the exported folder with ``init_from`` at
  TP=2 x PP=2 and fits one step at lr=0. The parent
  checks, against a TP=1 GPTModel built from the live shards merged by the layout contract (each TP
  rank's SwiGLU ``linear_fc1`` is ``[gate_r; up_r]``; independent of the checkpoint and export code):
  transformers' logits of the folder within 1e-5, its tokenizer, and the shards ``init_from`` restores
  equal to the trained ones, with the reference's loss on the batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import LossRecorder, local_shards, make_trainer

VOCAB, SEQ = 97, 16
LR = 1e-2
COMMON = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, max_sequence_length=SEQ,
              hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.2)
FAMILIES = {  # GPTConfig fields
    "llama": dict(COMMON, spec="llama_layer_spec", num_query_groups=2, ffn_hidden_size=48, activation="silu",
                  gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope",
                  untie_embeddings_and_output_weights=True, rotary_base=5000.0),
    "gpt2": dict(COMMON, spec="gpt_layer_spec", ffn_hidden_size=64, activation="gelu_tanh"),
}


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))


def _batches(n: int = 2, per_batch: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        seq = torch.randint(0, VOCAB, (per_batch, SEQ + 1), generator=g)
        out.append({"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(per_batch, SEQ)})
    return out


def _tokenizer_json(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


# ------------------------------------------------------------------------------ one process


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_folder_through_from_pretrained_gives_transformers_logits(tmp_path, family):
    import transformers

    from lightning_megatron.models.gpt.module import GPTLightningModule

    torch.manual_seed(0)
    if family == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, rope_theta=5000.0,
            initializer_range=0.2, bos_token_id=0, eos_token_id=0))
    else:
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2,
            bos_token_id=0, eos_token_id=0))
    hf.save_pretrained(tmp_path / "hf")
    module = GPTLightningModule.from_pretrained(str(tmp_path / "hf"))
    assert {k: module.hparams["config"][k] for k in ("spec", "num_query_groups", "rotary_base")} == {
        "spec": FAMILIES[family]["spec"], "num_query_groups": 2 if family == "llama" else 4,  # 4: one per head
        "rotary_base": 5000.0 if family == "llama" else 10000.0}
    module.configure_model()
    module.eval()
    with torch.no_grad():
        ours = module.model_chunks[0](_tokens())[..., :VOCAB]
        theirs = hf.eval()(input_ids=_tokens()).logits
    err = float((ours - theirs).abs().max())
    assert err <= 1e-5, f"max |ours - transformers| = {err:.2e} (largest logit {float(theirs.abs().max()):.2f})"


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")  # pytest's own argv is there too
def test_cli_init_from_a_llama_folder_turns_the_gpt2_recipe_into_llama_and_refuses_disagreeing_flags(tmp_path):
    """`fit --config recipes/gpt_tiny.yaml --model.init_from LLAMA_FOLDER`: the architecture comes from its
    config.json (spec, rope, SwiGLU, query groups, no biases, untied), replacing the GPT-2 recipe's."""
    import transformers

    from lightning_megatron.cli_lightning import lightning_cli

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      rope_theta=5000.0, bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    root = Path(__file__).resolve().parents[1]
    args = ["--config", str(root / "recipes/gpt_tiny.yaml"), "--trainer.devices", "1",
            "--trainer.strategy.tensor_model_parallel_size", "1", "--trainer.logger", "false",
            "--model.init_from", str(tmp_path / "llama"),
            "--data.seq_length", str(SEQ)]  # within the folder's positions (checked before launch)
    spec = "replaces the recipe's .*spec='gpt_layer_spec' \\(now 'llama_layer_spec'\\)"
    with pytest.warns(UserWarning, match=spec) as said:
        cli = lightning_cli(run=False, args=args)
    # the recipe's length replaced too (a rope model's run may choose another, below), and said
    [replaced] = [str(w.message) for w in said if "replaces the recipe's" in str(w.message)]
    assert replaced.count(f"config.max_sequence_length=128 (now {SEQ})") == 1, replaced
    # only what the recipe writes: GPTConfig's defaults it never wrote are not "the recipe's" (num_query_groups=None
    # (now 2), kv_channels=None, ... were listed among them)
    assert "num_query_groups" not in replaced and "kv_channels" not in replaced, replaced
    # the dropouts the folder suggests (Llama: none) replace the recipe's, said; a flag keeps its own
    assert "config.hidden_dropout=0.1 (now 0.0)" in replaced and "config.attention_dropout=0.1 (now 0.0)" in replaced
    assert (cli.model.config.hidden_dropout, cli.model.config.attention_dropout) == (0.0, 0.0)
    with pytest.warns(UserWarning, match="replaces the recipe's") as said:
        flagged = lightning_cli(run=False, args=[*args, "--model.config.hidden_dropout", "0.05"])
    [replaced] = [str(w.message) for w in said if "replaces the recipe's" in str(w.message)]
    assert "hidden_dropout" not in replaced and flagged.model.config.hidden_dropout == 0.05, replaced
    with pytest.warns(UserWarning, match="replaces the recipe's") as said:  # a rope recipe's length: replaced alike
        lightning_cli(run=False, args=[*args, "--model.config.position_embedding_type", "rope"])
    [replaced] = [str(w.message) for w in said if "replaces the recipe's" in str(w.message)]
    assert f"config.max_sequence_length=128 (now {SEQ})" in replaced, replaced
    hp = cli.model.config
    assert (hp.num_layers, hp.num_query_groups, hp.gated_linear_unit, hp.add_bias_linear, hp.position_embedding_type,
            hp.rotary_base, hp.untie_embeddings_and_output_weights, hp.vocab_size) == (
        3, 2, True, False, "rope", 5000.0, True, VOCAB)
    assert cli.model.hparams["config"]["spec"] == "llama_layer_spec"
    with pytest.raises(SystemExit, match=r"--model.config.num_layers 2 \(the source has 3\)"):
        lightning_cli(run=False, args=[*args, "--model.config.num_layers", "2"])
    # rope's positions are no weights: a longer context than the folder's is this run's choice (it was refused)
    with pytest.warns(UserWarning, match="replaces the recipe's"):
        longer = lightning_cli(run=False, args=[*args, "--model.config.max_sequence_length", str(4 * SEQ),
                                                "--data.seq_length", str(4 * SEQ)])
    assert (longer.model.config.max_sequence_length, longer.datamodule.seq_length) == (4 * SEQ, 4 * SEQ)


# ------------------------------------------------------------------------------ TP=2 x PP=2


def _worker(root: str) -> dict:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_megatron.cli import main
    from lightning_megatron.models.gpt import GPTConfig
    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.strategy import MegatronStrategy
    from lightning_megatron.tensor_parallel import pad_vocab_size

    results: dict = {}
    loader = DataLoader(_batches(), batch_size=None)
    for family, kwargs in FAMILIES.items():
        res: dict = {}
        ckpt, folder = f"{root}/{family}/ckpt", f"{root}/{family}/hf"
        module = GPTLightningModule(GPTConfig(**kwargs), lr=LR)
        tp2pp2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=2)
        trainer = make_trainer(MegatronStrategy(**tp2pp2), 4, 1)
        trainer.fit(module, train_dataloaders=loader)
        trainer.save_checkpoint(ckpt)
        ps = module.parallel_state
        res["coords"] = dict(tp_rank=ps.tp_rank, dp_rank=ps.dp_rank, pp_rank=ps.pp_rank)
        res["shards"] = local_shards(module)
        if dist.get_rank() == 0:  # the command line's `export hf`, in this process
            main(["export", "hf", "--ckpt_path", ckpt, "--output", folder,
                  "--tokenizer", str(_tokenizer_json(Path(root) / "tokenizer.json"))])
        dist.barrier()
        if family != "llama":  # the restore below matters for the strided (SwiGLU) fc1; GPT-2's is BERT's path
            results[family] = res
            continue
        # A step at lr=0 (no update): the loss of the restored model at TP=2 x PP=2, its shards unchanged.
        restored = GPTLightningModule(GPTConfig(**kwargs), lr=0.0, init_from=folder)
        recorder = LossRecorder()
        make_trainer(MegatronStrategy(**tp2pp2), 4, 1, callbacks=[recorder]).fit(restored, train_dataloaders=loader)
        res["restored_loss"] = recorder.losses[0]
        mine, start = local_shards(restored), ps.tp_rank * pad_vocab_size(VOCAB, 2) // 2  # this rank's first row
        real = slice(0, max(0, VOCAB - start))  # the vocabulary rows that are not padding
        res["restored_differ"] = sorted(set(mine) ^ set(res["shards"])) + [
            k for k in mine if k in res["shards"] and not torch.equal(
                *(t[real] if k in ("embedding.word_embeddings.weight", "output_layer.weight") else t
                  for t in (mine[k][0], res["shards"][k][0])))]
        # A Megatron-LM checkpoint of the folder with a bias on layer 1 (stage 1's) that no parameter takes: every
        # stage refuses it, stage 0 too (which holds no layer 1: the stages agree on what no one took).
        source = f"{root}/{family}/megatron"
        if dist.get_rank() == 0:
            import transformers

            from lightning_megatron.models.gpt import hf as ghf
            from lightning_megatron.models.gpt import hf_config as ghc
            from test_gpt_megatron_import import _write_legacy

            hf = transformers.LlamaForCausalLM.from_pretrained(folder)
            arch = ghc.hf_architecture(hf.config)
            _write_legacy(Path(source), ghf.gpt_state_dict_from_hf(hf.state_dict(), arch), arch, None,
                          extra={"decoder.layers.1.mlp.linear_fc2.bias": torch.ones(32)})
        dist.barrier()
        unread = GPTLightningModule(GPTConfig(**kwargs), lr=0.0, init_from=source)
        unread.connect_parallel_state(ps)
        try:
            unread.configure_model()
        except ValueError as e:
            res["unread"] = str(e)
        results[family] = res
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_interop")
    return root, run_distributed(_worker, 4, str(root), timeout=500)


def _reference(per_rank: list[dict], family: str):
    """A TP=1 GPTModel with the trained shards merged by the layout contract (SwiGLU fc1: [gate_r; up_r])."""
    from lightning_megatron.models.gpt.model import GPTModel
    from lightning_megatron.transformer import TransformerConfig

    kw = FAMILIES[family]
    gated = kw.get("gated_linear_unit", False)
    parts: dict[str, list] = {}
    for r in per_rank:
        for name, (t, dim) in r[family]["shards"].items():
            parts.setdefault(name, []).append((r[family]["coords"]["tp_rank"], t, dim))
    full = {}
    for name, ranked in parts.items():
        ranked = sorted({rank: (t, d) for rank, t, d in ranked}.items())
        tensors, dim = [t for _, (t, _) in ranked], ranked[0][1][1]
        if dim is None:
            full[name] = tensors[0]
        elif gated and ".mlp.linear_fc1." in name:
            halves = [t.chunk(2) for t in tensors]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            full[name] = torch.cat(tensors, dim=dim)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full[name] = full[name][:VOCAB]  # the padding rows
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=kw.get("num_query_groups"),
        ffn_hidden_size=kw["ffn_hidden_size"], hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5,
        normalization="RMSNorm" if family == "llama" else "LayerNorm", activation=kw["activation"],
        gated_linear_unit=gated, add_bias_linear=kw.get("add_bias_linear", True),
        rotary_base=kw.get("rotary_base", 10000.0))
    model = GPTModel(config, kw["spec"], VOCAB, SEQ, position_embedding_type=kw.get("position_embedding_type",
                                                                                    "learned_absolute"),
                     share_embeddings_and_output_weights=not kw.get("untie_embeddings_and_output_weights", False),
                     make_vocab_size_divisible_by=1)
    model.load_state_dict(full, strict=True)  # strict: every tensor of the model was merged
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_export_from_tp2pp2_matches_transformers_and_init_from_restores_it(measured, family):
    import transformers

    from lightning_megatron.models.gpt.model import gpt_loss

    root, per_rank = measured
    folder = root / family / "hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer("w3 w5 <|endoftext|>")["input_ids"] == [3, 5, VOCAB - 1]
    ours = _reference(per_rank, family)
    with torch.no_grad():
        want = ours(_tokens())[..., :VOCAB]
        got = hf(input_ids=_tokens()).logits
        losses = [gpt_loss(ours(b["tokens"], labels=b["labels"]), b["loss_mask"]) for b in _batches()[:1]]
    err = float((got - want).abs().max())
    assert err <= 1e-5, f"max |transformers - ours| = {err:.2e} (largest logit {float(want.abs().max()):.2f})"
    if family != "llama":
        return
    assert [r[family]["restored_differ"] for r in per_rank] == [[]] * 4, "init_from the export: shards differ"
    for r in per_rank:  # every stage refuses the tensor no stage takes
        assert "1 tensors no parameter of the model takes, e.g. ['decoder.layers.1.mlp.linear_fc2.bias']" in (
            r[family].get("unread") or ""), r[family].get("unread")
    for r in per_rank:  # the loss every rank logs is the last stage's, broadcast
        assert abs(r[family]["restored_loss"] - float(losses[0])) <= 1e-5 * float(losses[0]), (
            r[family]["restored_loss"], float(losses[0]))


def test_a_resumed_run_keeps_the_dropouts_it_trained_with(tmp_path):
    """`fit --ckpt_path CKPT` of a run started with ``init_from``: the source's suggested settings (its dropouts) give
    way to the checkpoint's, so that a run started before the source's dropouts were read (our defaults, 0.1) or from
    a source read otherwise now does not change them mid-run; the architecture still comes from the source."""
    from lightning_megatron.cli_config import _saved_settings
    from lightning_megatron.models.gpt.module import GPTLightningModule

    (tmp_path / "ckpt").mkdir()
    torch.save({"hyper_parameters": {"config": {"hidden_dropout": 0.1, "attention_dropout": 0.1, "num_layers": 3}}},
               tmp_path / "ckpt" / "extra.pt")
    source = {"num_layers": 3, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    assert _saved_settings(str(tmp_path / "ckpt"), GPTLightningModule, source) == {"hidden_dropout": 0.1,
                                                                                   "attention_dropout": 0.1}
    assert _saved_settings(None, GPTLightningModule, source) == {}  # a new run: the source's
    assert _saved_settings(str(tmp_path / "nope"), GPTLightningModule, source) == {}
