"""LoRA adapters (lightning_megatron/transformer/lora.py), checked against peft and through the CLI.

- One process: our adapters on the fused qkv / fc1 and on proj / fc2 compute peft's LoRA on transformers'
  ``LlamaForCausalLM`` with the same base weights and adapter weights: loss and every adapter gradient within
  1e-5 (fp32). peft's three q/k/v ``lora_A`` gradients sum to our shared A's; the frozen base gets none.
- Through the CLI (``finetune fit`` of an HF folder with ``--model.lora.*`` at TP=2): the checkpoint holds the
  adapters alone and the base's checksum; ``load_from_checkpoint`` reads the base again and refuses a changed
  one; ``export hf`` (merged) and ``export peft`` (PeftModel.from_pretrained) give our logits in transformers.
- ``check`` on the SFT recipe (chat data, an HF folder): LoRA at TP=2 with sequence parallelism and at PP=2, full
  fine-tuning at TP=2: losses, grad norms and gradients equal one process (the parity the check command proves).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dist_utils import run_python

from lightning_megatron.models.gpt import hf as ghf
from lightning_megatron.models.gpt import hf_config as ghc
from lightning_megatron.transformer.lora import LoRAConfig, merged_state_dict

REPO = Path(__file__).resolve().parents[1]
VOCAB_JSON = REPO / "lightning_megatron" / "data" / "vocab" / "gpt-bpe-8192.json"
PEFT_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama_folder(path: Path, *, vocab: int, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random transformers Llama (grouped-query attention, SwiGLU, untied head) saved with a tokenizer."""
    import transformers

    torch.manual_seed(seed)
    eos = vocab - 1
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, rope_theta=5000.0,
                                      initializer_range=0.1)  # peaked logits: greedy tokens without near-ties
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def _copy_into_peft(peft_model, ours: dict[str, torch.Tensor], arch: dict) -> None:
    """Our adapter tensors into peft's modules (the shared A on q, k, v / gate, up; B's rows split as the weight's)."""
    n, g = arch["num_attention_heads"], arch["num_query_groups"]
    layers = peft_model.base_model.model.model.layers
    with torch.no_grad():
        for i, layer in enumerate(layers):
            pre = f"decoder.layers.{i}."

            def adapter(name):
                return ours[f"{pre}{name}.adapter.linear_in.weight"], ours[f"{pre}{name}.adapter.linear_out.weight"]

            a, b = adapter("self_attention.linear_qkv")
            for module, part in zip((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                                    ghf.qkv_to_separate(b, n, g)):
                module.lora_A["default"].weight.copy_(a)
                module.lora_B["default"].weight.copy_(part)
            a, b = adapter("mlp.linear_fc1")
            for module, part in zip((layer.mlp.gate_proj, layer.mlp.up_proj), b.chunk(2)):
                module.lora_A["default"].weight.copy_(a)
                module.lora_B["default"].weight.copy_(part)
            for module, name in ((layer.self_attn.o_proj, "self_attention.linear_proj"),
                                 (layer.mlp.down_proj, "mlp.linear_fc2")):
                a, b = adapter(name)
                module.lora_A["default"].weight.copy_(a)
                module.lora_B["default"].weight.copy_(b)


def test_lora_equals_peft_on_transformers_loss_and_adapter_gradients(tmp_path):
    import peft
    import transformers

    from lightning_megatron.models.gpt.module import GPTLightningModule

    vocab = 97
    folder = _llama_folder(tmp_path / "base", vocab=vocab)
    module = GPTLightningModule.from_pretrained(str(folder), lora={"rank": 4, "alpha": 8.0},
                                                config={"hidden_dropout": 0.0, "attention_dropout": 0.0})
    module.configure_model()
    chunk = module.model_chunks[0]
    trainable = [n for n, p in chunk.global_named_parameters() if p.requires_grad]
    assert trainable and all(".adapter.linear_" in n for n in trainable) and len(trainable) == 2 * 4 * 2
    assert [n for n, _ in module.sharded_named_parameters()] == trainable  # what checkpoints hold
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B is zero at the start (no gradient reaches A): give it values, on both sides
        for name, p in chunk.named_parameters():
            if name.endswith("adapter.linear_out.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    tokens, labels = torch.randint(0, vocab, (2, 16), generator=g), torch.randint(0, vocab, (2, 16), generator=g)
    loss, _ = module.loss_forward({"tokens": tokens, "labels": labels, "loss_mask": torch.ones(2, 16)}, chunk)
    loss.backward()
    ours = dict(chunk.global_named_parameters())
    assert all(p.grad is None for n, p in ours.items() if n not in trainable)  # the base is frozen

    hf = transformers.LlamaForCausalLM.from_pretrained(folder)
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PEFT_MODULES))
    arch = ghc.hf_architecture(hf.config)
    _copy_into_peft(theirs, {n: p.detach() for n, p in ours.items()}, arch)
    logits = theirs(input_ids=tokens).logits
    their_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
    their_loss.backward()
    assert abs(float(loss) - float(their_loss)) <= 1e-5

    n, gq = arch["num_attention_heads"], arch["num_query_groups"]
    worst = 0.0
    for i, layer in enumerate(theirs.base_model.model.model.layers):
        pre = f"decoder.layers.{i}."

        def grad(name, side):
            return ours[f"{pre}{name}.adapter.linear_{side}.weight"].grad

        attn, mlp = layer.self_attn, layer.mlp
        pairs = [
            (grad("self_attention.linear_qkv", "in"), sum(m.lora_A["default"].weight.grad
                                                          for m in (attn.q_proj, attn.k_proj, attn.v_proj))),
            (grad("self_attention.linear_qkv", "out"), ghf.qkv_from_separate(
                *(m.lora_B["default"].weight.grad for m in (attn.q_proj, attn.k_proj, attn.v_proj)), n, gq)),
            (grad("mlp.linear_fc1", "in"), mlp.gate_proj.lora_A["default"].weight.grad
             + mlp.up_proj.lora_A["default"].weight.grad),
            (grad("mlp.linear_fc1", "out"), torch.cat([mlp.gate_proj.lora_B["default"].weight.grad,
                                                       mlp.up_proj.lora_B["default"].weight.grad])),
            (grad("self_attention.linear_proj", "in"), attn.o_proj.lora_A["default"].weight.grad),
            (grad("self_attention.linear_proj", "out"), attn.o_proj.lora_B["default"].weight.grad),
            (grad("mlp.linear_fc2", "in"), mlp.down_proj.lora_A["default"].weight.grad),
            (grad("mlp.linear_fc2", "out"), mlp.down_proj.lora_B["default"].weight.grad),
        ]
        for mine, want in pairs:
            assert float(want.abs().max()) > 1e-4  # a gradient that could disagree
            worst = max(worst, float((mine - want).abs().max()))
    assert worst <= 1e-5, f"max |our adapter grad - peft's| = {worst:.2e}"


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_lora_under_full_recomputation_trains_the_first_layers_adapters(tmp_path, method):
    """The frozen embedding feeds the first recomputed layers an input that needs no gradient: their adapters got
    none (``block``: the first layer's stayed 0, the grad norm 17% low, unsaid) or the backward failed
    (``uniform``). Every adapter gradient equals the run without recomputation."""
    from lightning_megatron.models.gpt.module import GPTLightningModule

    folder = _llama_folder(tmp_path / "base", vocab=97)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 97, (2, 16), generator=g), torch.randint(0, 97, (2, 16), generator=g)
    grads = []
    for recompute in ({}, {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": 1}):
        module = GPTLightningModule.from_pretrained(str(folder), lora={"rank": 4, "alpha": 8.0}, config={
            "hidden_dropout": 0.0, "attention_dropout": 0.0, **recompute})
        module.configure_model()
        chunk = module.model_chunks[0]
        with torch.no_grad():  # B is zero at the start: values, so A's gradients are not zero
            for name, p in chunk.named_parameters():
                if name.endswith("adapter.linear_out.weight"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
        loss, _ = module.loss_forward({"tokens": tokens, "labels": labels, "loss_mask": torch.ones(2, 16)}, chunk)
        loss.backward()
        grads.append({n: p.grad for n, p in chunk.global_named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    assert all(grads[1][n] is not None and float(grads[1][n].abs().max()) > 0 for n in grads[1])
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=1e-6, atol=1e-7, msg=name)


def test_a_qwen3_lora_exports_a_peft_folder_with_our_logits(tmp_path, monkeypatch):
    """A LoRA of a Qwen3 folder (norms of queries and keys) -> ``write_peft_folder`` -> ``PeftModel`` over
    transformers' Qwen3: our logits with the adapters within 1e-5 (Qwen3 adapters were refused until 2026-12-07)."""
    import peft
    import transformers

    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.models.gpt.peft import write_peft_folder

    vocab = 97
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.2)).eval()
    hf.save_pretrained(tmp_path / "base")
    module = GPTLightningModule.from_pretrained(str(tmp_path / "base"), lora={"rank": 4, "alpha": 8.0},
                                                config={"hidden_dropout": 0.0, "attention_dropout": 0.0})
    module.configure_model()
    chunk = module.eval().model_chunks[0]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero: values, so the adapters move the logits
        for name, p in chunk.named_parameters():
            if name.endswith("adapter.linear_out.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    tokens = torch.randint(0, vocab, (2, 16), generator=g)
    with torch.no_grad():
        ours = chunk(tokens)[..., :vocab]
        base = hf(input_ids=tokens).logits
    adapters = {n: p.detach() for n, p in chunk.global_named_parameters() if ".adapter." in n}
    arch = ghc.hf_architecture(hf.config)
    monkeypatch.chdir(tmp_path)  # the base named as the run named it, relative: written absolute
    write_peft_folder(adapters, arch, module.lora, tmp_path / "peft", base_model="base")
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    theirs = peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        logits = theirs(input_ids=tokens).logits
    assert float((ours - base).abs().max()) > 0.1  # the adapters change the logits
    assert float((logits - ours).abs().max()) <= 1e-5


def test_a_lora_steps_logged_flops_are_what_it_executes(tmp_path):
    """A LoRA run logs (``training_flops``: ThroughputCallback's TFLOP/s and MFU) the FLOPs its step executes, as
    ``check --estimate-time`` counts them: the frozen weights' forward and input-gradient GEMMs without their weight
    gradients (the output layer's too), the adapters' six per weight and token. Against torch's FlopCounterMode over
    a forward and backward (the unfused attention, whose matmuls it sees; V = 256, no padding), less what autograd
    skips because nothing before the first layer trains: its fused QKV projection's input gradient and its shared
    adapter A's. It logged the full training count before (the frozen weights' weight gradients, no adapters)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_megatron.models.gpt.module import GPTLightningModule

    folder = _llama_folder(tmp_path / "base", vocab=256)
    module = GPTLightningModule.from_pretrained(str(folder), lora={"rank": 4}, config={
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "attention_backend": "unfused"})
    module.configure_model()
    ids = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(3, 16)}
    with FlopCounterMode(display=False) as counter:
        output, loss_func = module.forward_step(batch, module.model_chunks[0])
        loss_func(output)[0].backward()
    tokens, h, qkv, rank = 3 * 16, 64, (4 + 2 * 2) * 16, 4  # 4 query heads, 2 groups, head dim 16
    skipped = 2 * tokens * h * qkv + 2 * tokens * h * rank
    assert module.training_flops(batch, data_parallel_size=1) == pytest.approx(
        counter.get_total_flops() + skipped, rel=1e-9), counter.get_flop_counts()


def test_merge_is_w_plus_scaled_b_a_and_config_refusals():
    lora = LoRAConfig(rank=2, alpha=6.0, target_modules=["linear_fc2"])
    w, a, b = torch.randn(5, 3), torch.randn(2, 3), torch.randn(5, 2)
    merged = merged_state_dict({"x.linear_fc2.weight": w, "x.linear_fc2.adapter.linear_in.weight": a,
                                "x.linear_fc2.adapter.linear_out.weight": b, "y": torch.ones(1)}, lora)
    assert set(merged) == {"x.linear_fc2.weight", "y"}
    torch.testing.assert_close(merged["x.linear_fc2.weight"], w + 3.0 * b @ a)
    with pytest.raises(ValueError, match=r"lora.rank=0 must be an integer >= 1"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match=r"target_modules=\['q_proj'\]: choose among"):
        LoRAConfig(target_modules=["q_proj"])


def _lora_recipe(tmp_path: Path, base: Path, data: str) -> Path:
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(f"""\
base: {REPO / "recipes" / "_gpt_pretraining.yaml"}
trainer:
  accelerator: cpu
  devices: 2
  precision: 32-true
  max_steps: 2
  val_check_interval: 2
  limit_val_batches: 1
  logger: false
  enable_progress_bar: false
  default_root_dir: {tmp_path / "run"}
  strategy:
    class_path: lightning_megatron.strategy.MegatronStrategy
    init_args:
      tensor_model_parallel_size: 2
lr_schedule:
  max_lr: 1.0e-3
  min_lr: 1.0e-4
  lr_warmup_steps: 0
model:
  class_path: lightning_megatron.models.gpt.module.GPTLightningModule
  init_args:
    init_from: {base}
    lora: {{rank: 4, alpha: 8, dropout: 0.05}}
data:
{data}""")
    return recipe


def _sft_data(base: Path) -> str:
    return f"""\
  class_path: lightning_megatron.datamodules.sft.SFTDataModule
  init_args:
    tokenizer: {base}
    seq_length: 64
    global_batch_size: 4
    micro_batch_size: 2
    val_fraction: 0.1
"""


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    run = run_python(["-m", "lightning_megatron.cli", *args], REPO, dict(os.environ), timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_lora_cli_fit_checkpoint_holds_adapters_and_exports_give_our_logits(tmp_path):
    import peft
    import transformers

    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.saved_model import read_model_checkpoint, state_digest

    base = _llama_folder(tmp_path / "base", vocab=8192)
    shutil.copy(VOCAB_JSON, base / "tokenizer.json")
    recipe = _lora_recipe(tmp_path, base, _sft_data(base))
    # the loss per token of the global batch (the chats' assistant tokens), as a fine-tuning user sets it
    _cli("finetune", "fit", "--config", str(recipe), "--lr_schedule.max_lr", "0.01",
         "--model.init_args.calculate_per_token_loss", "true")
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"

    saved = read_model_checkpoint(ckpt)  # the adapters alone, and the base they adapt by checksum
    assert saved.state_dict and all(".adapter.linear_" in k for k in saved.state_dict)
    assert len(saved.state_dict) == 2 * 4 * 2
    assert saved.module_hparams["init_from_sha256"] == state_digest(GPTLightningModule.read_pretrained(str(base)).state_dict)

    assert saved.module_hparams["calculate_per_token_loss"] is True
    module = GPTLightningModule.load_from_checkpoint(ckpt)
    tokens = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = module.model_chunks[0](tokens)[..., :8192]
        plain = transformers.LlamaForCausalLM.from_pretrained(base).eval()(input_ids=tokens).logits
    assert float((ours - plain).abs().max()) > 1e-3  # the adapters trained: they move the logits

    from lightning_megatron.cli import main

    main(["export", "hf", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "merged")])
    main(["export", "peft", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "adapter")])
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=tokens).logits
        with_adapter = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base),
                                                      tmp_path / "adapter").eval()(input_ids=tokens).logits
    assert float((merged - ours).abs().max()) <= 1e-5
    assert float((with_adapter - ours).abs().max()) <= 1e-5
    # the exported tokenizer renders chats as the run was trained on them (its chat template, its end of turn)
    from lightning_megatron.data.chat import ChatTokenizer

    chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}]
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    trained = ChatTokenizer(base)
    assert exported.apply_chat_template(chat, tokenize=False) == trained.template().render(chat)
    assert exported.eos_token == trained.eos_token

    # finetune predict continues chat prompts at TP=2 (rendered with the generation prompt, stopped at the end of
    # turn): the tokens equal our greedy generation of the checkpoint in this process
    import json

    from lightning_megatron.datamodules.sft import SFTDataModule

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is the capital of France?"}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "Name a prime number, please."}]}) + "\n")
    _cli("finetune", "predict", "--config", str(recipe), "--ckpt_path", str(ckpt), "--data.init_args.predict_file",
         str(prompts), "--model.init_args.predict_max_new_tokens", "6")
    rows = [json.loads(line) for line in (tmp_path / "run" / "predictions" / "predictions.jsonl").open()]
    data = SFTDataModule(predict_file=str(prompts), tokenizer=str(base), seq_length=64, global_batch_size=4,
                         micro_batch_size=2)
    read = data.read_prompts()
    want = module.generate([torch.tensor(ids) for ids in read.ids], 6, tokenizer=data.tokenizer)
    assert [r["prompt"] for r in rows] == read.texts and read.texts[0].endswith("<|im_start|>assistant\n")
    assert [r["token_ids"] for r in rows] == [w[len(ids):].tolist() for w, ids in zip(want, read.ids)]

    # The base changed under the adapters: every load path refuses it, naming both checksums.
    from safetensors.torch import load_file, save_file

    weights = load_file(base / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 0.5
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="init_from_sha256="):
        GPTLightningModule.load_from_checkpoint(ckpt)
    with pytest.raises(SystemExit):
        main(["export", "hf", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "merged2")])


def test_a_full_fine_tune_goes_on_from_its_checkpoint_and_adapters_load_on_our_own_base(tmp_path):
    """The decoder walkthrough of docs/finetune.md on our own base (``recipes/gpt_tiny.yaml``, shrunk, pretrained a
    step: its vocabulary is the datamodule's, its record says ``vocab_size: None``), with a fine-tuning recipe that
    names no architecture (``init_from`` gives it). ``--model.lora null`` (every weight trains) resumes with
    ``--ckpt_path last`` and is validated from its checkpoint: both were refused before launch (the architecture of
    ``init_from`` was not applied to a command with a checkpoint: ``GPTConfig``'s defaults, which the checkpoint does
    not fit). LoRA adapters on the base load with ``load_from_checkpoint`` (it raised ``config.vocab_size is None``:
    the adapters' checkpoint holds no embedding to count): the base's embedding rows, from its checkpoint metadata."""
    from lightning_megatron.checkpoint import checkpoint_identity
    from lightning_megatron.models.gpt.module import GPTLightningModule

    _cli("fit", "--config", str(REPO / "recipes" / "gpt_tiny.yaml"), "--model.config.num_layers", "1",
         "--model.config.hidden_size", "32", "--model.config.num_attention_heads", "2", "--model.config.ffn_hidden_size",
         "64", "--data.global_batch_size", "4", "--data.micro_batch_size", "2", "--data.seq_length", "32",
         "--trainer.limit_val_batches", "0", "--trainer.max_steps", "1", "--lr_schedule.lr_warmup_steps", "0",
         "--trainer.default_root_dir", str(tmp_path / "base"), "--trainer.logger", "false")
    base = tmp_path / "base" / "checkpoints" / "last.ckpt"
    data = _sft_data(base).replace(f"tokenizer: {base}", "tokenizer: null").replace("seq_length: 64", "seq_length: 32")
    recipe = _lora_recipe(tmp_path, base, data)
    full = ("--model.init_args.lora", "null", "--trainer.limit_val_batches", "0")
    first = _cli("finetune", "fit", "--config", str(recipe), *full, "--trainer.max_steps", "1",
                 "--model.init_args.weight_decay", "0.05", "--model.init_args.lr", "5e-4")
    # the schedule sets the weight decay: a model's of another value is not used, and that is said before launch
    assert ("model.weight_decay=0.05 is not used: the lr_schedule section sets the weight decay every step "
            "(start_wd=0.1, end_wd=0.1); to train with 0.05: --lr_schedule.start_wd 0.05") in first.stderr
    assert "model.lr=0.0005 is not used: the lr_schedule section sets the lr every step (init_lr=" in first.stderr
    assert "; to peak at 0.0005: --lr_schedule.max_lr 0.0005" in first.stderr  # Megatron-LM's --lr
    _cli("finetune", "fit", "--config", str(recipe), *full, "--trainer.max_steps", "2", "--ckpt_path", "last")
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert checkpoint_identity(str(ckpt))[1] == 2
    validated = _cli("finetune", "validate", "--config", str(recipe), "--model.init_args.lora", "null",
                     "--ckpt_path", str(ckpt))
    assert "val_loss" in validated.stdout + validated.stderr

    (tmp_path / "adapters").mkdir()
    adapters = _lora_recipe(tmp_path / "adapters", base, data)
    _cli("finetune", "fit", "--config", str(adapters), "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
         "--model.init_args.lora.dropout", "0")
    lora_ckpt = tmp_path / "adapters" / "run" / "checkpoints" / "last.ckpt"
    # evaluated with the recipe's adapters' dropout (0.05), as hidden_dropout may differ: it was refused (the lora
    # record compared whole), and is said now
    validated = _cli("finetune", "validate", "--config", str(adapters), "--ckpt_path", str(lora_ckpt))
    assert "lora.dropout: checkpoint 0.0, model 0.05" in validated.stderr, validated.stderr[-3000:]
    module = GPTLightningModule.load_from_checkpoint(lora_ckpt)
    assert module.vocab_size == 8192 and module.config.num_layers == 1 and module.lora is not None


def test_sft_and_lora_layouts_equal_one_process_through_check(tmp_path):
    """``check`` on the SFT recipe from an HF folder: LoRA at TP=2 without and with sequence parallelism and at
    PP=2, and full fine-tuning at TP=2, give one process's losses, grad norms and gradients; its memory table
    (``--estimate-memory``) measures the parameters a rank holds, the frozen base's too, as predicted. The recipe's
    adapters have dropout, which the check turns off as every other (it left it on: every layout FAILed). What each
    rank sends (``--estimate-time``) is the time model's within 0.5%: the adapters' ``[s, b, r]`` collectives and,
    under SP, their A gathered, the first layer's input gradient not reduced (the frozen embedding needs none), the
    row-parallel adapters' B summed once a step, no tied-embedding gradient between the stages (recipes/
    gpt_tiny_lora.yaml at PP=2 4.5 predicted against 0.5 MiB sent, TP=2 9.01 against 9.14)."""
    from check_tables import assert_traffic

    base = _llama_folder(tmp_path / "base", vocab=8192)
    shutil.copy(VOCAB_JSON, base / "tokenizer.json")
    recipe = _lora_recipe(tmp_path, base, _sft_data(base))
    # SGD: Adam's first step divides a gradient by its magnitude + eps (1e-8), and B's gradient has elements near
    # 4e-9, where the reductions' round-off (~3e-9 here) changes the update by O(lr): an ill-conditioned step, not
    # a difference in the math (with SGD every layout stays equal over the steps; with Adam step 1 is equal).
    lora = _cli("check", "--config", str(recipe), "--layouts", "tp2,tp2sp,pp2", "--steps", "3",
                "--model.optimizer", "sgd", "--model.calculate_per_token_loss", "true", "--estimate-memory",
                "--estimate-time").stdout
    assert "tp2            PASS" in lora and "tp2sp          PASS" in lora and "pp2            PASS" in lora, lora
    assert_traffic(lora, [("tp2", 0), ("tp2sp", 0), ("pp2", 0), ("pp2", 1)])
    lora = lora.split("predicted step time")[0]
    assert ".adapter.linear_" in lora
    # The memory table: every parameter held (the frozen base too) and the adapters' gradients, as predicted
    rows = [line.split() for line in lora.split("memory per rank")[1].splitlines()[2:] if line.strip()]
    assert [r[0] for r in rows] == ["tp1", "tp2", "tp2sp", "pp2", "pp2"], lora  # a row for each stage
    for row in rows:
        params, grads = row[2].split("/"), row[3].split("/")
        assert params[0] == params[1] and grads[0] == grads[1], row
    full = _cli("check", "--config", str(recipe), "--layouts", "tp2", "--steps", "2", "--model.lora", "null").stdout
    assert "tp2            PASS" in full
    [worst] = [line.split()[-1] for line in full.splitlines() if line.startswith("tp2               1 ")]
    assert ".adapter." not in worst, worst  # the base trains too: its gradients are compared


def test_lora_settings_are_refused_before_launch(tmp_path):
    """What the pre-launch check refuses: adapters without a base, a rank TP does not divide."""
    from lightning_megatron.models.gpt.module import GPTLightningModule
    from lightning_megatron.parallel_dims import ParallelDims

    problems = GPTLightningModule.config_problems
    assert problems({"lora": {"rank": 8}}, None) == [
        "model.lora adapts pretrained weights: set model.init_from (a Hugging Face folder or a checkpoint); its "
        "checkpoints hold the adapters only"]
    [odd] = problems({"lora": {"rank": 6}, "init_from": "x"}, ParallelDims(tp=4))
    assert odd.startswith("model.lora.rank=6 must be divisible by tensor_model_parallel_size=4"), odd
    assert problems({"lora": {"rank": 6, "target_modules": ["linear_proj"]}, "init_from": "x"},
                    ParallelDims(tp=4)) == []  # row-parallel adapters keep the whole rank
    [bad] = problems({"lora": {"rank": 8, "alpha": -1}, "init_from": "x"}, None)
    assert bad == "model.lora.alpha=-1 must be > 0", bad


def test_chats_encoded_with_another_tokenizer_than_the_base_folders_are_refused(tmp_path):
    """SFTDataModule's ``tokenizer: null`` is the packaged BPE: for a base that brings its own tokenizer.json the ids
    would be valid and the text wrong, so the pre-launch check refuses it, naming the folder to use."""
    from lightning_megatron.config_checks import check_config
    from lightning_megatron.datamodules.sft import SFTDataModule
    from lightning_megatron.models.gpt.module import GPTLightningModule

    (tmp_path / "tokenizer.json").write_text("{}")
    model = {"init_from": str(tmp_path), "lora": {"rank": 8}}
    problems = check_config(model, {"tokenizer": None, "seq_length": 64}, data_class=SFTDataModule,
                            model_class=GPTLightningModule, running=False)
    assert any(p.startswith("data tokenizer=None encodes the chats with the packaged BPE, but model init_from=")
               and p.endswith(f"set data.tokenizer={str(tmp_path)!r}") for p in problems), problems
    problems = check_config(model, {"tokenizer": str(tmp_path), "seq_length": 64}, data_class=SFTDataModule,
                            model_class=GPTLightningModule, running=False)
    assert not any("packaged BPE" in p for p in problems), problems


def _adapted_projection_backward(sequence_parallel: bool) -> dict:
    """On 2 TP ranks: a column-parallel projection with a LoRA adapter, forward and backward; the TP reductions
    of activation-sized tensors ([tokens, h]) its backward runs, and its input's gradient."""
    from torch import nn

    from lightning_megatron.parallel_dims import ParallelDims
    from lightning_megatron.parallel_state import initialize_model_parallel
    from lightning_megatron.tensor_parallel import ColumnParallelLinear, mappings
    from lightning_megatron.tensor_parallel.random import model_parallel_seed
    from lightning_megatron.transformer.lora import ADAPTER_OUT, LoRAConfig, add_lora

    ps = initialize_model_parallel(ParallelDims(tp=2, sequence_parallel=sequence_parallel))
    model_parallel_seed(0, ps.tp_rank)
    s, b, h = 8, 2, 16
    holder = nn.Module()
    holder.linear_fc1 = ColumnParallelLinear(h, 32, tp_group=ps.tp_group, bias=False,
                                             sequence_parallel=sequence_parallel)
    add_lora(holder, LoRAConfig(rank=4, target_modules=["linear_fc1"]),
             global_names={id(p): n for n, p in holder.named_parameters()})
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if name.endswith(ADAPTER_OUT):
                p.normal_()
    g = torch.Generator().manual_seed(ps.tp_rank if sequence_parallel else 0)  # SP: each rank its part
    x = torch.randn(s // 2 if sequence_parallel else s, b, h, generator=g, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in holder.parameters()}
    kept: dict[int, int] = {}  # storage -> elements of the tensors autograd keeps for the backward (not parameters)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = holder.linear_fc1(x)
    reductions = []
    real_all_reduce, real_reduce_scatter = mappings.all_reduce, mappings.reduce_scatter_tensor

    def all_reduce(t, group, *args, **kwargs):
        reductions.append(("all_reduce", t.numel()))
        return real_all_reduce(t, group, *args, **kwargs)

    def reduce_scatter_tensor(out, t, group, *args, **kwargs):
        reductions.append(("reduce_scatter", t.numel()))
        return real_reduce_scatter(out, t, group, *args, **kwargs)

    mappings.all_reduce, mappings.reduce_scatter_tensor = all_reduce, reduce_scatter_tensor
    try:
        y.pow(2).sum().backward()
    finally:
        mappings.all_reduce, mappings.reduce_scatter_tensor = real_all_reduce, real_reduce_scatter
    return {"activation_sized": [kind for kind, n in reductions if n >= s * b * h], "x_grad": x.grad,
            "largest_kept": max(kept.values()), "gathered": s * b * h}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2sp"])
def test_an_adapted_column_projection_reduces_its_input_gradient_once(sequence_parallel):
    """A LoRA adapter on a column-parallel projection reads the input its base layer copied over TP, so the input's
    gradient, the base's part and the adapter's summed first, is all-reduced over TP once, as without the adapter,
    not twice. Under sequence parallelism it reads this rank's part of the sequence, with A's rows gathered, and
    gathers its [s/t, b, r] output along the sequence: it keeps that part for A's gradient, not the [s, b, h]
    gathered input (the frozen base keeps none), and the input's gradient is still reduce-scattered once (the
    adapter's part of it is this rank's already). The values are checked by the layouts against one process
    (``test_sft_and_lora_layouts_equal_one_process``)."""
    from dist_utils import run_distributed

    ranks = run_distributed(_adapted_projection_backward, 2, sequence_parallel, timeout=120)
    for r in ranks:
        assert r["activation_sized"] == ["reduce_scatter" if sequence_parallel else "all_reduce"], r["activation_sized"]
        assert r["largest_kept"] == (r["gathered"] // 2 if sequence_parallel else r["gathered"]), r
    if not sequence_parallel:  # a replicated input: its gradient is the same on both ranks
        assert torch.equal(ranks[0]["x_grad"], ranks[1]["x_grad"])
