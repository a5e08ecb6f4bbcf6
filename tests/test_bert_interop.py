"""From a checkpoint to a model people use: export to Hugging Face, test/predict, load_from_checkpoint, init_from.

One spawned run of 4 gloo ranks, for both specs (post-norm -> BertForPreTraining, the default pre-norm ->
MegatronBertForPreTraining):
- 1 training step at TP=2 x PP=2, checkpoint; ``trainer.test`` and ``trainer.predict`` (masked-LM ids
  and hidden states) at TP=2 x PP=2 and, from the checkpoint, at TP=2 x DP=2;
- rank 0 exports the checkpoint (``export_hf``); every rank then starts a new module from the exported
  folder with ``init_from`` at TP=2 x PP=2 and predicts hidden states again.
The parent checks, against a TP=1 reference built from the gathered shards (independent of the export
code): transformers' logits and hidden states within 1e-5, predictions at every layout equal to it,
``load_from_checkpoint`` on the directory, and a fill-mask pipeline on the folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from megatron_testing import TINY_CONFIG, TINY_MODEL, VOCAB, SyntheticBertDataset, full_params, local_shards, \
    make_trainer, synthetic_datamodule

SPECS = ("bert_layer_post_norm_spec", "bert_layer_local_spec")
MODEL = {**TINY_MODEL, "config": {**TINY_CONFIG, "num_layers": 2}}


def _with_spec(spec: str) -> dict:
    """MODEL's arguments with the layer spec ``spec``."""
    return {**MODEL, "config": {**MODEL["config"], "spec": spec}}


def _batches(n: int = 4, per_batch: int = 4) -> list[dict[str, torch.Tensor]]:
    ds = SyntheticBertDataset(64, seed=7)
    samples = [ds[i] for i in range(n * per_batch)]
    return [{k: torch.stack([s[k] for s in samples[b * per_batch:(b + 1) * per_batch]]) for k in samples[0]}
            for b in range(n)]


def write_vocab(path: Path, size: int = VOCAB) -> Path:
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(size - 5)]
    path.write_text("\n".join(words) + "\n")
    return path


def _predict(spec: str, strategy_kwargs: dict, batches, mode: str, ckpt_path: str | None = None,
             callbacks: list | None = None, **model_kwargs):
    from torch.utils.data import DataLoader

    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    module = BertLightningModule(**_with_spec(spec), predict_output=mode, **model_kwargs)
    strategy = MegatronStrategy(micro_batch_size=2, **strategy_kwargs)
    trainer = make_trainer(strategy, 4, 0, callbacks=callbacks)
    out = trainer.predict(module, dataloaders=DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    if out is None or out[0] is None:
        return None
    if isinstance(out[0], dict):  # masked_lm: the top-k ids and probabilities; the argmax is the first
        return torch.cat([o["ids"][..., 0] for o in out])
    return torch.cat(out)


def _worker(root: str) -> dict:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_megatron.export import export_hf
    from lightning_megatron.models.bert.module import BertLightningModule
    from lightning_megatron.strategy import MegatronStrategy

    rank = dist.get_rank()
    batches = _batches()
    results: dict = {}
    for spec in SPECS:
        res: dict = {}
        ckpt = f"{root}/{spec}/ckpt"
        module = BertLightningModule(**_with_spec(spec))
        strategy = MegatronStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        trainer = make_trainer(strategy, 4, 1)
        dm = synthetic_datamodule(8, 2, 1, 0)
        trainer.fit(module, datamodule=dm)
        trainer.save_checkpoint(ckpt)
        ps = module.parallel_state
        res["coords"] = dict(tp_rank=ps.tp_rank, dp_rank=ps.dp_rank, pp_rank=ps.pp_rank)
        res["shards"] = local_shards(module)
        [metrics] = trainer.test(module, dataloaders=DataLoader(batches, batch_size=None), verbose=False)
        res["test_lm_loss"] = float(metrics["test_lm_loss"])
        # the same strategy's second run (test after fit) keeps the process groups (it built a new set per run: on
        # NCCL each set's communicators hold GPU memory)
        res["same_groups"] = trainer.strategy.parallel_state is ps and module.parallel_state is ps
        tp2pp2 = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        tp2dp2 = dict(tensor_model_parallel_size=2)
        res["ids_tp2pp2"] = _predict(spec, tp2pp2, batches, "masked_lm", ckpt_path=ckpt)
        res["hidden_tp2pp2"] = _predict(spec, tp2pp2, batches, "hidden", ckpt_path=ckpt)
        res["hidden_tp2dp2"] = _predict(spec, tp2dp2, batches, "hidden", ckpt_path=ckpt)
        from lightning_megatron.callbacks import PredictionWriter
        from lightning_megatron.data.predict import SAMPLE_INDEX

        # the PredictionWriter at DP=2 as a user's sampler feeds it: each replica its own batches (the odd ones on
        # DP rank 0), the rows' indices with them
        dp_rank = rank // 2  # TP=2 x DP=2: TP is the fastest-varying rank coordinate
        mine = [{**b, SAMPLE_INDEX: torch.arange(4 * i, 4 * i + 4)} for i, b in enumerate(batches)
                if i % 2 != dp_rank]
        res["pooled_tp2dp2"] = _predict(spec, tp2dp2, mine, "pooled", ckpt_path=ckpt,
                                        callbacks=[PredictionWriter(output_dir=f"{root}/{spec}/predictions")])
        if rank == 0:
            export_hf(ckpt, f"{root}/{spec}/hf", vocab_file=write_vocab(Path(root) / "vocab.txt"))
        dist.barrier()
        res["hidden_init_from_hf"] = _predict(spec, tp2pp2, batches, "hidden", init_from=f"{root}/{spec}/hf")
        results[spec] = res
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    return root, run_distributed(_worker, 4, str(root), timeout=400)


def _reference(per_rank: list[dict], spec: str):
    """A TP=1 BertModel with the gathered trained weights."""
    from lightning_megatron.models.bert import BertModel
    from lightning_megatron.transformer import TransformerConfig

    shards = [{**r[spec]["coords"], "shards": r[spec]["shards"]} for r in per_rank]
    full = full_params(shards, tp=2)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-12)
    model = BertModel(cfg, spec, VOCAB, MODEL["config"]["max_sequence_length"], make_vocab_size_divisible_by=1).eval()
    model.load_state_dict(full, strict=True)
    return model


def _last_stage(per_rank: list[dict], spec: str, key: str) -> torch.Tensor:
    outs = [r[spec][key] for r in per_rank if r[spec][key] is not None]
    assert outs, f"no rank returned {key}"
    for o in outs[1:]:  # every TP rank (and DP replica: same batches) returns the same predictions
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0)
    return outs[0]


@pytest.mark.parametrize("spec", SPECS)
def test_export_from_tp2pp2_matches_transformers(measured, spec):
    import transformers

    root, per_rank = measured
    folder = root / spec / "hf"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert (folder / "tokenizer_config.json").is_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.vocab_size == VOCAB and tokenizer.convert_tokens_to_ids("w7") == 12
    hf = transformers.AutoModelForPreTraining.from_pretrained(folder).eval()
    expected_cls = "BertForPreTraining" if spec == "bert_layer_post_norm_spec" else "MegatronBertForPreTraining"
    assert type(hf).__name__ == expected_cls
    mlm = transformers.AutoModelForMaskedLM.from_pretrained(folder).eval()
    ours = _reference(per_rank, spec)
    ids_ref, hidden_ref = [], []
    for b in _batches():
        with torch.no_grad():
            logits, binary = ours(b["tokens"], b["attention_mask"], b["token_types"])
            hidden = ours(b["tokens"], b["attention_mask"], b["token_types"], return_hidden_states=True)
            out = hf(input_ids=b["tokens"], attention_mask=b["attention_mask"], token_type_ids=b["token_types"],
                     output_hidden_states=True)
            mlm_logits = mlm(input_ids=b["tokens"], attention_mask=b["attention_mask"],
                             token_type_ids=b["token_types"]).logits
        torch.testing.assert_close(out.prediction_logits, logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(mlm_logits, logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(out.seq_relationship_logits, binary, rtol=0, atol=1e-5)
        torch.testing.assert_close(out.hidden_states[-1], hidden.transpose(0, 1), rtol=0, atol=1e-5)
        ids_ref.append(logits.argmax(-1))
        hidden_ref.append(hidden.transpose(0, 1))
    ids_ref, hidden_ref = torch.cat(ids_ref), torch.cat(hidden_ref)
    # predict through the strategy at TP=2 x PP=2, at TP=2 x DP=2 from the checkpoint, and after init_from.
    assert torch.equal(_last_stage(per_rank, spec, "ids_tp2pp2"), ids_ref)
    for key in ("hidden_tp2pp2", "hidden_tp2dp2", "hidden_init_from_hf"):
        torch.testing.assert_close(_last_stage(per_rank, spec, key), hidden_ref, rtol=0, atol=1e-5)
    pooled = torch.tanh(ours.pooler.dense(hidden_ref[:, 0])).detach()
    for rank, r in enumerate(per_rank):  # each DP replica predicted its own batches: 1 and 3 (rows 4-7, 12-15); 0, 2
        rows = torch.cat([torch.arange(4 * i, 4 * i + 4) for i in range(4) if i % 2 != rank // 2])
        if r[spec]["pooled_tp2dp2"] is not None:
            torch.testing.assert_close(r[spec]["pooled_tp2dp2"], pooled[rows], rtol=0, atol=1e-5)
    # The PredictionWriter: one pooled.npy of every row in input order, the replicas' rows gathered; index.npy
    import numpy as np

    predictions = root / spec / "predictions"
    assert sorted(p.name for p in predictions.iterdir()) == ["index.npy", "pooled.npy"]
    assert np.load(predictions / "index.npy").tolist() == list(range(16))
    torch.testing.assert_close(torch.from_numpy(np.load(predictions / "pooled.npy")), pooled, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS)
def test_test_loss_and_load_from_checkpoint(measured, spec):
    from lightning_megatron import checkpoint as ckpt
    from lightning_megatron.models.bert import bert_loss
    from lightning_megatron.models.bert.module import BertLightningModule

    root, per_rank = measured
    ours = _reference(per_rank, spec)
    losses = []
    for b in _batches():
        with torch.no_grad():
            lm_loss, _ = ours(b["tokens"], b["attention_mask"], b["token_types"], lm_labels=b["lm_labels"])
        losses.append(bert_loss(lm_loss, b["loss_mask"])[1]["lm_loss"])
    expected = float(torch.stack(losses).mean())
    for r in per_rank:
        assert abs(r[spec]["test_lm_loss"] - expected) <= 1e-5 * abs(expected)
        assert r[spec]["same_groups"]
    loaded = BertLightningModule.load_from_checkpoint(root / spec / "ckpt")
    b = _batches()[0]
    with torch.no_grad():
        got, _ = loaded.model_chunks[0](b["tokens"], b["attention_mask"], b["token_types"])
        want, _ = ours(b["tokens"], b["attention_mask"], b["token_types"])
    torch.testing.assert_close(got[..., :VOCAB], want, rtol=0, atol=1e-6)
    with pytest.raises(ckpt.CheckpointError, match="not a lightning_megatron checkpoint"):
        BertLightningModule.load_from_checkpoint(root / spec / "hf")


def test_fill_mask_pipeline_runs_on_export(measured):
    import transformers

    root, _ = measured
    fill = transformers.pipeline("fill-mask", model=str(root / "bert_layer_local_spec" / "hf"), device="cpu")
    out = fill("w1 w2 [MASK] w4", top_k=3)
    assert len(out) == 3 and all(o["token_str"] for o in out)


def test_init_from_architecture_mismatch_names_the_flags():
    from lightning_megatron.models.bert.interop import check_architecture

    source = {"num_layers": 6, "hidden_size": 384, "spec": "bert_layer_post_norm_spec", "activation": "gelu"}
    with pytest.raises(ValueError, match="--model.config.num_layers 6 --model.config.hidden_size 384 "
                                         "--model.config.spec bert_layer_post_norm_spec"):
        check_architecture({**MODEL["config"], "spec": "bert_layer_local_spec", "activation": "gelu"}, source, "src")
    check_architecture({**MODEL["config"], **source}, source, "src")  # matching: no error


def test_any_torch_optim_optimizer_keeps_our_param_groups():
    from lightning_megatron.models.bert.module import BertLightningModule

    module = BertLightningModule(**MODEL, optimizer_class="torch.optim.SGD",
                                 optimizer_kwargs={"momentum": 0.9, "nesterov": True, "dampening": 0.0})
    module.configure_model()
    opt = module.configure_optimizers()
    assert type(opt) is torch.optim.SGD and opt.defaults["nesterov"] is True
    decays = sorted({g["weight_decay"] for g in opt.param_groups})
    assert decays == [0.0, MODEL["weight_decay"]]  # no decay on biases and norms, as with the built-in ones
    with pytest.raises(ValueError, match="not a torch.optim optimizer"):
        bad = BertLightningModule(**MODEL, optimizer_class="os.system")
        bad.configure_model()
        bad.configure_optimizers()
