"""SFT data (``lightning_megatron.data.chat``, ``SFTDataModule``): chat templates rendered and tokenized as
transformers' ``apply_chat_template`` does (Llama 3 and ChatML templates, a tiny byte-level BPE made here),
the loss on the assistant's content and end-of-turn tokens only, prompt/completion records, truncation,
packing (and that the decoder gives each packed example the loss it gives it alone), splits, and exact resume
(also through a Lightning fit)."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import transformers
from dist_utils import accelerator

from lightning_megatron.data.chat import (DEFAULT_CHAT_TEMPLATE, ChatRecord, ChatTemplate, ChatTokenizer, encode_chat,
                                          packaged_sample_file, read_chat_records)
from lightning_megatron.data.sft_samples import SFTSamples, first_fit, fit_examples
from lightning_megatron.datamodules import SFTDataModule

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
"""Meta-Llama-3-8B-Instruct's template."""
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
          "system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n'"
          " + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>"
          "assistant\n' }}{% endif %}")
"""Qwen2-Instruct's template (ChatML, a default system message)."""
CHATML_TAGGED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] "
                 "== 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
                 "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""ChatML with transformers' ``{% generation %}`` marks."""
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CONFIGS = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3},
    "chatml": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML},
    "tagged": {"eos_token": "<|im_end|>", "chat_template": CHATML_TAGGED},
    "none": {"eos_token": {"content": "<|endoftext|>", "special": True, "__type": "AddedToken"}},
}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, what's 2+2?"},
        {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, of course.", "note": None}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One tiny byte-level BPE (trained on the packaged sample chats, the special tokens added), in a folder
    per template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = tmp_path_factory.mktemp("sft-tokenizers")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(packaged_sample_file().read_text().splitlines(), trainer)
    out = {}
    for name, config in CONFIGS.items():
        folder = root / name
        folder.mkdir()
        tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                  **config}))
        out[name] = folder
    return out


def _runs(tokenizer: ChatTokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The text of every run of consecutive masked tokens."""
    runs, at = [], 0
    for masked, group in itertools.groupby(mask):
        n = len(list(group))
        if masked:
            runs.append(tokenizer.detokenize(ids[at:at + n].tolist()))
        at += n
    return runs


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("name", ["llama3", "chatml", "tagged"])
def test_rendering_and_tokens_equal_transformers(folders, name):
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folders[name])
    ours = ChatTokenizer(folders[name])
    template = ours.template()
    assert ours.template_source == "tokenizer_config.json" and ours.eos_token == hf.eos_token
    for messages in (CHAT, CHAT[1:], CHAT[1:3]):
        text = template.render(messages)
        assert text == hf.apply_chat_template(messages, tokenize=False)
        ids, _ = encode_chat(ChatRecord(messages, "test"), ours, template)
        assert ids.tolist() == hf.apply_chat_template(messages, tokenize=True, return_dict=False)
        prompt = template.render(messages[:-1], add_generation_prompt=True)
        assert prompt == hf.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)


def test_loss_mask_is_the_assistant_content_and_end_of_turn(folders):
    for name, end in (("llama3", "<|eot_id|>"), ("chatml", "<|im_end|>")):
        tokenizer = ChatTokenizer(folders[name])
        for messages in (CHAT, CHAT[1:]):  # ChatML's template adds a system message when there is none
            ids, mask = encode_chat(ChatRecord(messages, "test"), tokenizer, tokenizer.template())
            assert _runs(tokenizer, ids, mask) == [f"It is 4.{end}", f"6, of course.{end}"], name
    # Llama 3 trims the content; the loss starts at the rendered text
    tokenizer = ChatTokenizer(folders["llama3"])
    padded = [*CHAT[1:4], {"role": "assistant", "content": "  six \n"}]
    ids, mask = encode_chat(ChatRecord(padded, "test"), tokenizer, tokenizer.template())
    assert _runs(tokenizer, ids, mask)[-1] == "six<|eot_id|>"


def test_generation_marks_give_transformers_assistant_mask_and_the_prefix_rule_agrees(folders):
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folders["tagged"])
    tokenizer = ChatTokenizer(folders["tagged"])
    template = tokenizer.template()
    assert template.has_generation_tags
    ids, mask = encode_chat(ChatRecord(CHAT, "test"), tokenizer, template)
    expected = hf.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
    assert mask.astype(int).tolist() == expected
    # The same layout without the marks: the prefix renderings find the same tokens.
    untagged = ChatTemplate(CHATML_TAGGED.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
                            tokenizer.special_tokens)
    assert not untagged.has_generation_tags
    ids2, mask2 = encode_chat(ChatRecord(CHAT, "test"), tokenizer, untagged)
    assert ids2.tolist() == ids.tolist() and mask2.tolist() == mask.tolist()
    # an answer's own leading and trailing spaces, which ChatML keeps: targets as the marks make them (the prefix rule
    # searched the stripped answer, and left the leading spaces out of the loss)
    spaced = [*CHAT[1:4], {"role": "assistant", "content": "  Blue.  "}]
    expected = hf.apply_chat_template(spaced, return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
    ids3, mask3 = encode_chat(ChatRecord(spaced, "test"), tokenizer, untagged)
    assert mask3.astype(int).tolist() == expected
    assert _runs(tokenizer, ids3, mask3)[-1] == "  Blue.  <|im_end|>"


def test_template_sources_default_and_refusals(folders, tmp_path):
    plain = ChatTokenizer(folders["none"] / "tokenizer.json")
    assert plain.template_source == "default" and plain.chat_template == DEFAULT_CHAT_TEMPLATE
    assert plain.eos_token == "<|endoftext|>" and plain.eod == plain.tokenize("<|endoftext|>")[0]
    ids, mask = encode_chat(ChatRecord(CHAT[1:3], "test"), plain, plain.template())
    assert plain.detokenize(ids.tolist()) == ("<|im_start|>user\nHi there, what's 2+2?<|endoftext|>\n"
                                              "<|im_start|>assistant\nIt is 4.<|endoftext|>\n")
    assert _runs(plain, ids, mask) == ["It is 4.<|endoftext|>"]
    # chat_template.jinja beats the config's; an argument beats both; a named template is chosen by name
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((folders["chatml"] / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": [
        {"name": "default", "template": CHATML}, {"name": "llama", "template": LLAMA3}]}))
    assert ChatTokenizer(folder).chat_template == CHATML
    assert ChatTokenizer(folder, chat_template="llama").chat_template == LLAMA3
    (folder / "chat_template.jinja").write_text(CHATML_TAGGED)
    assert ChatTokenizer(folder).template_source == "chat_template.jinja"
    assert ChatTokenizer(folder, chat_template="{{ 'x' }}").chat_template == "{{ 'x' }}"
    with pytest.raises(ValueError, match="neither a file, a template"):
        ChatTokenizer(folder, chat_template="nope")
    with pytest.raises(ValueError, match=r"'<\|nope\|>' is not in the vocabulary"):
        ChatTokenizer(folder, eos_token="<|nope|>")
    # the sandbox: no attribute escapes; raise_exception raises
    import jinja2

    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ ''.__class__.__mro__ }}", {}).render(CHAT)
    with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}", {}).render(CHAT)
    # a template that renders a message differently once others follow is refused
    late = "{% for m in messages %}{{ m['content'] + (m['role'] if loop.last else '') }}{% endfor %}"
    with pytest.raises(ValueError, match="renders message 2 .* differently once later messages follow"):
        encode_chat(ChatRecord(CHAT, "test"), plain, ChatTemplate(late, plain.special_tokens))


def test_records_prompt_completion_and_refusals(folders, tmp_path):
    path = _write(tmp_path / "a.jsonl", [
        {"messages": CHAT[1:3]}, {"system": "Be brief.", "prompt": "Hi there, what's 2+2?", "completion": "It is 4."},
        {"prompt": "The sun rises in the", "completion": " east."}])
    records = read_chat_records(path, "train")
    assert records[1].messages == CHAT[:3] and records[1].where == "train line 2"
    tokenizer = ChatTokenizer(folders["llama3"])
    template = tokenizer.template()
    assert encode_chat(records[1], tokenizer, template)[0].tolist() == \
        encode_chat(ChatRecord(CHAT[:3], "x"), tokenizer, template)[0].tolist()
    ids, mask = encode_chat(records[2], tokenizer, template, raw=True)  # the text, then EOS
    assert ids.tolist() == tokenizer.tokenize("The sun rises in the east.") + [tokenizer.eod]
    assert _runs(tokenizer, ids, mask) == [" east.<|eot_id|>"]
    with pytest.raises(ValueError, match="a 'system' needs the chat template"):
        encode_chat(records[1], tokenizer, template, raw=True)
    for bad, match in ((["not json"], "line 1 is not JSON"), ([{"text": "x"}], "'messages' .* or 'prompt'"),
                       ([{"messages": [{"role": "user", "content": "x"}]}], "no assistant message"),
                       ([{"messages": [{"role": "user", "content": ["x"]}]}], "content' is not a string"),
                       # a missing field is named (it said "'prompt' and 'completion' must be strings", and of a
                       # message without content "content parts are not supported")
                       ([{"prompt": "a", "response": "b"}], r"has a 'prompt' and no 'completion' \(the answer to "
                                                            r"learn; its keys: \['prompt', 'response'\]\)"),
                       ([{"messages": [{"role": "user", "text": "x"}]}],
                        r"the 'user' message has no 'content' \(its keys: \['role', 'text'\]\)"),
                       ([{"system": "s", "messages": CHAT}], "both 'system' and a system message")):
        (tmp_path / "bad.jsonl").write_text("\n".join(b if isinstance(b, str) else json.dumps(b) for b in bad))
        with pytest.raises(ValueError, match=match):
            read_chat_records(tmp_path / "bad.jsonl", "train")
    prompts = read_chat_records(_write(tmp_path / "p.jsonl", [{"prompt": "Hi"}, {"messages": CHAT[:2]}]), "p",
                                prompts=True)
    assert [len(r.messages) for r in prompts] == [1, 2]
    with pytest.raises(ValueError, match="ends with the assistant's message"):
        read_chat_records(_write(tmp_path / "q.jsonl", [{"messages": CHAT[:3]}]), "p", prompts=True)


def test_overlong_examples_truncated_dropped_or_refused():
    ids = np.arange(10)
    late = np.array([False] * 8 + [True] * 2)  # targets only in the last two tokens
    early = np.array([False, True] + [False] * 8)
    examples, wheres = [(ids, late), (ids, early), (ids[:4], early[:4])], ["a", "b", "c"]
    kept, stats = fit_examples(examples, wheres, 5, "truncate")  # 6 tokens fit
    assert [len(i) for i, _ in kept] == [6, 4]
    assert (stats.truncated, stats.dropped, stats.dropped_where) == (1, 1, ["a"])
    assert stats.targets == 2 and stats.examples == 2
    # what the datamodule's warning says: only what happened, with the numbers
    assert stats.overlong_line(5, "truncate") == ("1 of 3 examples cut to seq_length + 1 = 6 tokens; 1 left out, no "
                                                  "target left after the cut (first: a)")
    kept, stats = fit_examples(examples, wheres, 5, "drop")
    assert len(kept) == 1 and stats.dropped == 2
    assert stats.overlong_line(5, "drop") == "2 of 3 examples left out, longer than seq_length + 1 = 6 tokens (first: a, b)"
    assert fit_examples(examples[2:], wheres[2:], 5, "truncate")[1].overlong_line(5, "truncate") is None
    with pytest.raises(ValueError, match="a has 10 tokens, more than seq_length \\+ 1 = 6"):
        fit_examples(examples, wheres, 5, "error")
    with pytest.raises(ValueError, match="c: no assistant token"):
        fit_examples([(ids[:4], late[:4])], ["c"], 5, "truncate")


def test_first_fit_matches_the_plain_loop():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, 300).tolist()
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        b = next((b for b, r in enumerate(room) if r >= n), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(32)
        bins[b].append(i)
        room[b] -= n
    assert first_fit(lengths, 32) == bins
    with pytest.raises(ValueError, match=r"in \[1, 32\]"):
        first_fit([33], 32)


def _trainer(global_step=0, dp_rank=0, dp_size=1):
    strategy = SimpleNamespace(parallel_state=SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size))
    return SimpleNamespace(strategy=strategy, global_step=global_step)


def _datamodule(folder, *, step=0, state=None, dp=(0, 1), **kwargs) -> SFTDataModule:
    kwargs = dict(tokenizer=str(folder), seq_length=128, global_batch_size=4, micro_batch_size=2,
                  num_workers=0) | kwargs
    dm = SFTDataModule(**kwargs)
    dm.trainer = _trainer(step, *dp)
    if state is not None:
        dm.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sample's two longest chats are cut to 129 tokens
        dm.setup("fit")
    return dm


def test_packed_samples_keep_examples_apart(folders):
    unpacked, packed = (_datamodule(folders["chatml"], pack=p) for p in (False, True))
    examples = packed.datasets["train"].examples
    assert len(packed.datasets["train"]) < len(unpacked.datasets["train"]) == len(examples)
    one = unpacked.datasets["train"][0]
    assert set(one) == {"tokens", "labels", "loss_mask"} and one["tokens"].dtype == torch.int64
    n = len(examples[0][0]) - 1
    assert one["loss_mask"][n:].sum() == 0 and torch.equal(one["tokens"][1:n], one["labels"][:n - 1])
    seen = []
    for i, group in enumerate(packed.datasets["train"].groups):
        sample = packed.datasets["train"][i]
        at = 0
        for doc, e in enumerate(group):
            ids, mask = examples[e]
            span = slice(at, at + len(ids) - 1)
            assert sample["document_ids"][span].eq(doc).all()
            assert sample["position_ids"][span].tolist() == list(range(len(ids) - 1))
            # labels stay inside the example: its last input's label is its own last token, not the next one's first
            assert sample["tokens"][span].tolist() == ids[:-1].tolist()
            assert sample["labels"][span].tolist() == ids[1:].tolist()
            assert sample["loss_mask"][span].tolist() == mask[1:].astype(np.float32).tolist()
            at += len(ids) - 1
            seen.append(e)
        assert sample["loss_mask"][at:].sum() == 0 and sample["document_ids"][at:].eq(len(group)).all()
    assert sorted(seen) == list(range(len(examples)))


def test_packed_batch_gives_each_example_its_unpacked_loss(folders, device):
    """The decoder on a packed sample (position_ids, document_ids) gives every example's tokens the
    per-token losses it gives the example alone."""
    from lightning_megatron.models.gpt.config import GPTConfig
    from lightning_megatron.models.gpt.module import GPTLightningModule

    dm = _datamodule(folders["chatml"], pack=True)
    samples = dm.datasets["train"]
    torch.manual_seed(0)
    module = GPTLightningModule(config=GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=dm.vocab_size, max_sequence_length=128,
        spec="llama_layer_spec", position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0))
    module.configure_model()
    module.eval()
    chunk = module.model_chunks[0]

    def losses(sample):  # per-token loss where there is one, [s]
        batch = {k: v[None].to(device) for k, v in sample.items()}
        out = chunk(batch["tokens"], batch.get("position_ids"), labels=batch["labels"],
                    document_ids=batch.get("document_ids"))
        return (out * batch["loss_mask"])[0], batch

    i = max(range(len(samples)), key=lambda k: len(samples.groups[k]))
    assert len(samples.groups[i]) >= 2
    with torch.no_grad():
        packed, batch = losses(samples[i])
        for doc, e in enumerate(samples.groups[i]):
            alone, _ = losses(SFTSamples(samples.examples, [[e]], seq_length=128, pad_id=samples.pad_id,
                                         packed=False)[0])
            where = batch["document_ids"][0] == doc
            torch.testing.assert_close(packed[where], alone[:int(where.sum())], atol=1e-5, rtol=1e-5)


def test_splits_and_evaluation_batches(folders, tmp_path, caplog):
    import logging

    dm = _datamodule(folders["chatml"], val_fraction=0.2, seed=7)
    records = read_chat_records(packaged_sample_file(), "sample")
    val, train = dm.read_splits()["validation"], dm.read_splits()["train"]
    assert len(val) == 9 and len(val) + len(train) == len(records)
    assert {r.where for r in val}.isdisjoint(r.where for r in train)
    assert [r.where for r in _datamodule(folders["chatml"], val_fraction=0.2, seed=8).read_splits()["validation"]] \
        != [r.where for r in val]
    # validation: every sample once, in order, in full global batches (the padding without loss)
    loader = dm.val_dataloader()
    batches = list(loader)
    assert len(batches) == 3 and all(b["tokens"].shape == (4, 128) for b in batches)
    expected = [dm.datasets["validation"][i]["tokens"] for i in range(9)]
    assert all(torch.equal(a, b) for a, b in zip(torch.cat([b["tokens"] for b in batches])[:9], expected))
    assert batches[-1]["loss_mask"][1:].sum() == 0 and batches[-1]["loss_mask"][0].sum() > 0
    assert dm.test_dataloader() == []
    # a limit on the batches is said, once (limit_val_batches 0.5 scored 2 of 4 held-out chats, unsaid)
    caplog.set_level(logging.INFO)
    dm.trainer.limit_val_batches = 0.5
    dm.val_dataloader(), dm.val_dataloader()
    assert [r.getMessage() for r in caplog.records if "split" in r.getMessage()] == [
        "the validation split: limit_val_batches=0.5 scores 1 of its 3 global batches of 4 (4 of 9 samples)"]
    with pytest.raises(ValueError, match="use one of the two"):
        SFTDataModule(validation_file="v.jsonl", val_fraction=0.1, tokenizer=None)
    test_file = _write(tmp_path / "test.jsonl", [{"messages": CHAT}])
    dm = _datamodule(folders["chatml"], test_file=test_file)
    assert len(dm.datasets["test"]) == 1 and dm.val_dataloader() == []


def test_resume_sees_the_batches_it_would_have_seen(folders):
    def batches(dm, n):
        return [b["tokens"] for b, _ in zip(dm.train_dataloader(), range(n))]

    full = _datamodule(folders["chatml"], pack=True)
    per_epoch = len(full.train_dataloader())
    stream = []
    for step in range(per_epoch + 3):  # past an epoch: each epoch is another shuffle
        full.trainer.global_step = step
        stream.append(batches(full, 1)[0])
    assert not all(torch.equal(a, b) for a, b in zip(stream[:3], stream[per_epoch:per_epoch + 3]))
    # a run stopped at step k: its state, loaded into a new module, gives the next batches
    k = per_epoch - 1
    state = _datamodule(folders["chatml"], pack=True, step=k).state_dict()
    assert state == {"consumed_samples": 4 * k, "global_step": k}
    resumed = _datamodule(folders["chatml"], pack=True, step=k, state=state)
    assert all(torch.equal(a, b) for a, b in zip(batches(resumed, 4), stream[k:k + 4]))
    # two DP ranks at step k together hold the global batch of one
    halves = [batches(_datamodule(folders["chatml"], pack=True, step=k, dp=(r, 2)), 1)[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), stream[k])
    with pytest.raises(ValueError, match="not divisible by micro_batch_size=2 \\* data_parallel_size=3"):
        _datamodule(folders["chatml"], dp=(0, 3)).train_dataloader()


class _Recorder(pl.LightningModule):
    """Learns nothing; records the first tokens of every sample it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["tokens"][:, :12].tolist())
        return (self.weight * batch["loss_mask"].sum()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_resume_across_epochs(folders, tmp_path):
    def fit(max_steps, root, ckpt_path=None):
        model = _Recorder()
        dm = SFTDataModule(tokenizer=str(folders["chatml"]), seq_length=128, global_batch_size=8, micro_batch_size=8,
                           pack=True, num_workers=0)
        trainer = pl.Trainer(max_steps=max_steps, accelerator=accelerator(), devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=root, num_sanity_val_steps=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return trainer, model, dm

    _, full, dm = fit(7, tmp_path / "full")
    per_epoch = len(dm.train_dataloader())
    assert 2 < per_epoch < 4  # the run crosses two epochs; the resume below is mid-epoch
    assert full.seen[:per_epoch] != full.seen[per_epoch:2 * per_epoch]  # each epoch another shuffle
    trainer, first, _ = fit(2, tmp_path / "first")
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    assert torch.load(tmp_path / "step2.ckpt", weights_only=False)["SFTDataModule"]["consumed_samples"] == 16
    _, second, _ = fit(7, tmp_path / "second", ckpt_path=tmp_path / "step2.ckpt")
    assert len(full.seen) == 7 and first.seen + second.seen == full.seen


def test_predict_prompts_with_the_generation_prompt(folders, tmp_path):
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folders["llama3"])
    path = _write(tmp_path / "p.jsonl", [{"prompt": "Hi there, what's 2+2?"}, {"messages": CHAT[:4]},
                                         {"system": "Be brief.", "prompt": "Hi there, what's 2+2?"}])
    dm = SFTDataModule(train_file=str(tmp_path / "absent.jsonl"), predict_file=path, tokenizer=str(folders["llama3"]),
                       seq_length=128, global_batch_size=2, micro_batch_size=1, num_workers=0)
    dm.trainer = _trainer()
    dm.setup("predict")  # predict reads only its prompts
    batches = list(dm.predict_dataloader())
    got = {int(i): t[0].tolist() for b in batches for i, t in zip(b["sample_index"], b["tokens"][:, None]) if i >= 0}
    for i, messages in enumerate([CHAT[1:2], CHAT[:4], CHAT[:2]]):
        assert got[i] == hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert dm.predict_dataset.texts[0].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert dm.tokenizer.eod == hf.eos_token_id and dm.vocab_size == len(hf)


def test_logged_loss_leaves_out_microbatches_without_counted_tokens():
    """The validation split's last global batch is filled with copies that carry no loss (loss_mask 0): their
    microbatches log ``num_tokens`` 0 and weigh nothing, so ``val_loss`` stays the loss of the real rows
    (averaging them in as zeros halved it: val_loss 3.57 against val_perplexity 1257 = e^7.14). Evaluation weighs
    each microbatch by its tokens (the step's token mean: micro-batch 1, 4 and 8 gave val_loss 8.733, 8.736 and
    8.745 on the same chats, against val_perplexity 6276.2 = e^8.7445 for all); a training loss of microbatch
    means averages those (its objective), and with ``calculate_per_token_loss`` weighs them by tokens too.
    ``num_tokens`` is the step's count."""
    from types import SimpleNamespace

    from lightning_megatron.parallel_state import ParallelState
    from lightning_megatron.step import StepRunner

    runner = SimpleNamespace(ps=ParallelState.single_process(), per_token_loss=False)
    logged = [{"loss": torch.tensor(7.0), "num_tokens": torch.tensor(12.0)},
              {"loss": torch.tensor(6.0), "num_tokens": torch.tensor(4.0)},
              {"loss": torch.tensor(0.0), "num_tokens": torch.tensor(0.0)}]
    out = StepRunner._reduce_logged(runner, logged, "val")
    assert float(out["loss"]) == 6.75 and float(out["num_tokens"]) == 16.0  # (7 x 12 + 6 x 4) / 16
    out = StepRunner._reduce_logged(runner, logged, "train")
    assert float(out["loss"]) == 6.5 and float(out["num_tokens"]) == 16.0  # the two microbatches with tokens
    runner.per_token_loss = True
    assert float(StepRunner._reduce_logged(runner, logged, "train")["loss"]) == 6.75
    plain = StepRunner._reduce_logged(runner, [{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(2.0)}], "train")
    assert float(plain["loss"]) == 1.5  # a loss function that counts no tokens: the plain mean


def test_generation_stops_where_transformers_does_at_every_eos_of_the_generation_config(folders, tmp_path):
    """A Llama 3.1 Instruct folder's ``generation_config.json`` ends a generation at any of three ids
    (``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``); ``generate`` and ``predict`` stopped at the tokenizer's
    ``eos_token`` alone and went on past the others. A folder whose generation config names another id: our greedy
    generation from it (the tokenizer's stop ids) equals transformers' ``generate`` from the same folder, which stops
    there."""
    import shutil

    import transformers

    from lightning_megatron.models.gpt.module import GPTLightningModule

    folder = tmp_path / "llama"
    shutil.copytree(folders["llama3"], folder)
    tok = ChatTokenizer(folder)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=tok.eos_id, eos_token_id=tok.eos_id)).eval()
    prompt = torch.tensor([tok.tokenize("Hi there, what's 2+2?")])
    free = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_id)
    new = free[0, prompt.shape[1]:].tolist()
    other = next(t for t in new[2:] if t != tok.eos_id and t not in new[:2])  # a later token made a stop id
    hf.generation_config.eos_token_id = [other, tok.eos_id]
    hf.save_pretrained(folder)  # config.json, generation_config.json (the two stop ids), the weights
    tok = ChatTokenizer(folder)
    assert set(tok.stop_ids) == {other, tok.eos_id}
    theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_id)
    assert theirs.shape[1] < free.shape[1] and theirs[0, -1] == other  # transformers stopped there
    module = GPTLightningModule.from_pretrained(str(folder))
    module.configure_model()
    ours = module.eval().generate(prompt, 8, tokenizer=tok)
    assert ours.tolist() == theirs.tolist()
    assert module.stop_rule("eod", tokenizer=tok).completion(ours[0, prompt.shape[1]:].tolist()) == tok.detokenize(
        theirs[0, prompt.shape[1]:-1].tolist())


@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_export_of_a_chat_run_keeps_its_stop_ids_and_bos(folders, tmp_path, name):
    """``export hf`` of a run on a folder whose ``generation_config.json`` names several stop ids (Llama 3.1
    Instruct's three): ``predict`` stopped at each, the export's ``generate`` at the EOS alone (it ran on past a stop
    id); and the config's ``bos_token_id`` was the end-of-turn id (``generate()`` without a prompt began with
    ``<|eot_id|>``). The export's generation config stops where ``predict`` does; its BOS is the tokenizer's (else the
    end of document ``<|endoftext|>``, as GPT-2's)."""
    import shutil

    from test_interop_dispatch import saved_decoder

    from lightning_megatron.models.gpt.interop import GPTInterop

    source = tmp_path / "source"
    shutil.copytree(folders[name], source)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(source)
    stops = ["<|eot_id|>", "<|end_of_text|>"] if name == "llama3" else ["<|im_end|>", "<|endoftext|>"]
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": hf.convert_tokens_to_ids(stops)}))
    trained = ChatTokenizer(source)
    assert trained.stop_ids == tuple(hf.convert_tokens_to_ids(stops))
    saved, config = saved_decoder(len(hf), {"tokenizer": str(source), "chat_template": None, "eos_token": None})
    GPTInterop().hf_tokenizer(saved, config, None)(tmp_path / "hf")
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert generation.eos_token_id == list(trained.stop_ids)
    bos = "<|begin_of_text|>" if name == "llama3" else "<|endoftext|>"
    assert config.bos_token_id == hf.convert_tokens_to_ids(bos) and config.eos_token_id == trained.eos_id
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.apply_chat_template(CHAT, tokenize=True, return_dict=False) == hf.apply_chat_template(
        CHAT, tokenize=True, return_dict=False)
