"""Checkpoint format pieces in one process: chunk rectangles, DCP resharding through the public
planners, the metadata allow-list, checksums, the atomic swap and hyper-parameter comparison."""

from __future__ import annotations

import math
import os
import pickle
import re
import threading
import warnings
from pathlib import Path

import pytest
import torch

from lightning_megatron import checkpoint as ckpt
from lightning_megatron import dcp_io
from lightning_megatron.sharded_state import flat_range_boxes

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("shape", [(7,), (4, 3), (3, 4, 5)])
def test_flat_range_boxes_cover_each_range_exactly_once(shape):
    n = math.prod(shape)
    for a in range(n):
        for b in range(a + 1, n + 1):
            cover = torch.zeros(shape)
            flat = a
            boxes = flat_range_boxes(shape, a, b)
            for offsets, sizes, start in boxes:
                assert start == flat  # in order, each a contiguous flat range
                cover[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
                flat += math.prod(sizes)
            expected = torch.zeros(n)
            expected[a:b] = 1
            assert torch.equal(cover.reshape(-1), expected), (shape, a, b, boxes)
            assert len(boxes) <= 2 * len(shape) - 1


def _chunks(full: torch.Tensor, ranges: list[tuple[int, int]], out: bool = False) -> list[dcp_io.Chunks]:
    """One Chunks per "rank": the flat ranges of ``full`` as rectangles (zeros when ``out``)."""
    result = []
    for a, b in ranges:
        c = dcp_io.Chunks(tuple(full.shape))
        flat = (torch.zeros_like(full) if out else full.clone()).reshape(-1)
        for offsets, sizes, start in flat_range_boxes(tuple(full.shape), a, b):
            c.add(offsets, flat[start: start + math.prod(sizes)].view(sizes))
        result.append(c)
    return result


def test_chunks_reshard_through_public_planners_without_warnings(tmp_path):
    full = torch.randn(6, 5)
    step = torch.tensor(7.0)
    # Saved as 3 uneven flat ranges (one "rank" holding them all: DCP without a process group).
    saved = _chunks(full, [(0, 7), (7, 19), (19, 30)])
    merged = dcp_io.Chunks((6, 5), [p for c in saved for p in c.pieces])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp_io.save({"w": merged, "step": step}, tmp_path / "c")
        # Loaded as 2 other ranges: each destination reads only the overlapping saved pieces.
        dest = _chunks(full, [(0, 13), (13, 30)], out=True)
        got_step = torch.zeros(())
        for d in dest:
            dcp_io.load({"w": d, "step": got_step}, tmp_path / "c")
    assert [str(w.message) for w in caught] == []
    rebuilt = torch.zeros(30)
    for d, (a, b) in zip(dest, [(0, 13), (13, 30)]):
        for offsets, t in d.pieces:
            rebuilt.view(6, 5)[tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))] = t
    assert torch.equal(rebuilt.view(6, 5), full) and got_step.item() == 7.0
    with pytest.raises(dcp_io.CheckpointError, match=r"w: checkpoint shape \(6, 5\), model shape \(5, 6\)"):
        dcp_io.load({"w": torch.zeros(5, 6)}, tmp_path / "c")


class _Payload:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_metadata_payload_is_refused_and_never_runs(tmp_path):
    sentinel = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(sentinel)))
    with pytest.raises(dcp_io.CheckpointError, match=r"\.metadata cannot be loaded safely.*refusing.*system"):
        dcp_io.read_metadata(tmp_path)
    with pytest.raises(dcp_io.CheckpointError, match="refusing"):
        dcp_io.SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not sentinel.exists()


# The allow-list, pinned: a new entry must be argued for here (a class that runs code on construction,
# or a callable such as builtins.eval, would turn a .metadata file into a program).
PINNED_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def test_allow_list_is_exactly_the_pinned_one():
    assert set(dcp_io.ALLOWED_GLOBALS) == PINNED_ALLOWED_GLOBALS


class _Reduce:
    """Pickles as ``fn(*args)``: the shape of every code-running pickle payload."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(sentinel: Path) -> dict[str, object]:
    import builtins
    import subprocess

    touch = f"__import__('pathlib').Path({str(sentinel)!r}).touch()"
    return {
        "builtins.eval": _Reduce(builtins.eval, touch),
        "builtins.exec": _Reduce(builtins.exec, touch),
        "builtins.getattr": _Reduce(Path(sentinel).touch),  # a bound method pickles as getattr(obj, name)
        "builtins.__import__": _Reduce(builtins.__import__, "antigravity"),
        "subprocess.check_call": _Reduce(subprocess.check_call, ["touch", str(sentinel)]),
        "subprocess.Popen": _Reduce(subprocess.Popen, ["touch", str(sentinel)]),
        "posix.system": _Reduce(os.system, f"touch {sentinel}"),
    }


@pytest.mark.parametrize("name", ["builtins.eval", "builtins.exec", "builtins.getattr", "builtins.__import__",
                                  "subprocess.check_call", "subprocess.Popen", "posix.system"])
def test_code_running_payloads_are_refused(tmp_path, name):
    sentinel = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_payloads(sentinel)[name]))
    with pytest.raises(dcp_io.CheckpointError, match=rf"refusing to load global {re.escape(name)} "):
        dcp_io.read_metadata(tmp_path)
    assert not sentinel.exists()


def test_format_1_metadata_reads_through_the_allow_list(monkeypatch):
    md = dcp_io.read_metadata(DATA / "ckpt_v1_tp2")
    word = md.state_dict_metadata["model.embedding.word_embeddings.weight"]
    assert tuple(word.size) == (1000, 16) and len(word.chunks) == 2
    with pytest.raises(ckpt.CheckpointError, match="cannot be verified: it is format 1"):
        ckpt.verify_checkpoint(DATA / "ckpt_v1_tp2")
    monkeypatch.setenv(ckpt.ALLOW_UNVERIFIED_ENV, "1")
    assert ckpt.verify_checkpoint(DATA / "ckpt_v1_tp2")["format_version"] == 1


def test_checksum_mismatch_names_the_file(tmp_path):
    d = tmp_path / "c"
    dcp_io.save({"w": torch.arange(100.0)}, d)
    (d / "extra.pt").write_bytes(b"x")
    names = ckpt._files(d)
    info = {"format_version": 2, "files": {n: (d / n).stat().st_size for n in names},
            "sha256": {n: ckpt.file_sha256(d / n) for n in names}}
    (d / ckpt.MARKER).write_text(__import__("json").dumps(info))
    ckpt.verify_checkpoint(d)
    shard = next(d.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # same size, one bit
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=rf"{shard.name} does not match the sha256"):
        ckpt.verify_checkpoint(d)


def test_swap_never_leaves_the_name_missing_and_cleans_temporaries(tmp_path):
    final = tmp_path / "last.ckpt"
    final.mkdir()
    (final / "v").write_text("0")
    missing = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if not final.exists():
                missing.append(1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(1, 200):
            tmp = tmp_path / f"last.ckpt.tmp-{i}"
            tmp.mkdir()
            (tmp / "v").write_text(str(i))
            ckpt.finalize_directory(tmp, final)
    finally:
        stop.set()
        watcher.join()
    assert (final / "v").read_text() == "199" and not missing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    (tmp_path / "last.ckpt.tmp-dead").mkdir()
    (tmp_path / "other.ckpt.tmp-keep").mkdir()
    ckpt._clean_stale_temporaries(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "other.ckpt.tmp-keep"]
    # Two runs started at once into one folder: one's save removed the other's save in progress ("Parent directory
    # .../epoch=0-step=1.ckpt.tmp-68ee28c7/rng does not exist"). A save's temporary names its run; a save removes
    # its own run's (and unnamed ones, of before), never another run's.
    assert ckpt.save_temporary(final, "3f9c1a2b77").name.startswith("last.ckpt.tmp-3f9c1a2b.")
    for name in ("last.ckpt.tmp-3f9c1a2b.0badf00d", "last.ckpt.tmp-7d02e4c1.1234abcd", "last.ckpt.tmp-deadbeef"):
        (tmp_path / name).mkdir()
    ckpt._clean_stale_temporaries(final, "3f9c1a2b77")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.tmp-7d02e4c1.1234abcd",
                                                          "other.ckpt.tmp-keep"]


def test_compare_hparams_lists_every_differing_field():
    saved = {"num_attention_heads": 4, "hidden_size": 32, "lr": 1e-3, "spec": "a"}
    errors, allowed = ckpt.compare_hparams(saved, {**saved, "num_attention_heads": 2, "hidden_size": 64, "lr": 1.0})
    assert errors == ["hidden_size: checkpoint 32, model 64", "num_attention_heads: checkpoint 4, model 2"]
    assert allowed == ["lr: checkpoint 0.001, model 1.0"]
    # where the weights first came from: the checkpoint's replace them, so predicting from a fine-tuned run without
    # its --model.init_from says nothing about it
    assert ckpt.compare_hparams({**saved, "init_from": "runs/bert_tiny/checkpoints/last.ckpt"}, saved) == ([], [])
    # what `predict` does with the weights (sampling, what it writes): the command's own options, never the weights',
    # so sampling from a greedily-trained run's checkpoint does not warn of its own --model.predict_* options
    predicting = {"predict_greedy": False, "predict_temperature": 0.8, "predict_top_p": 0.9, "predict_top_k": 10,
                  "predict_max_new_tokens": 8, "predict_output": "pooled", "predict_stop_at_eod": False,
                  "predict_stop_strings": ["\n"]}
    assert ckpt.compare_hparams(saved, {**saved, **predicting}) == ([], [])
    # how context parallelism and the experts' tokens communicate: the same weights, the same math (a run at CP=2
    # with cp_comm_type a2a was refused when resumed at CP=1, whose default is all_gather)
    moved = {"config": {"cp_comm_type": "a2a", "moe_token_dispatcher_type": "alltoall", "num_layers": 2}}
    errors, allowed = ckpt.compare_hparams(moved, {"config": {"cp_comm_type": "all_gather", "num_layers": 2,
                                                              "moe_token_dispatcher_type": "allgather"}})
    assert errors == [] and allowed == ["config.cp_comm_type: checkpoint 'a2a', model 'all_gather'",
                                        "config.moe_token_dispatcher_type: checkpoint 'alltoall', model 'allgather'"]


def test_a_length_that_sizes_no_weight_may_differ_one_that_sizes_learned_positions_not():
    """A rope decoder's ``max_sequence_length`` sizes no tensor: a run at a longer context resumes from (or starts
    from) the weights of a shorter one, said as an allowed difference. GPT-2's learned positions are a tensor of
    that many rows: refused, and with the fix named."""
    from lightning_megatron.models.gpt.module import GPTLightningModule as GPT

    rope = {"config": {"position_embedding_type": "rope", "max_sequence_length": 32, "hidden_size": 32}}
    longer = {"config": {**rope["config"], "max_sequence_length": 64}}
    free = GPT.free_arguments(rope) & GPT.free_arguments(longer)
    assert free == {"max_sequence_length"}
    allowed = ["config.max_sequence_length: checkpoint 32, model 64"]
    assert ckpt.compare_hparams(rope, longer, free=free) == ([], allowed)
    learned = {"config": {**rope["config"], "position_embedding_type": "learned_absolute"}}
    assert GPT.free_arguments(learned) == frozenset()
    errors, _ = ckpt.compare_hparams(learned, {"config": {**learned["config"], "max_sequence_length": 64}})
    assert errors == ["config.max_sequence_length: checkpoint 32, model 64"]
    # init_from: a source that fixes the architecture fixes no rope length, but still a learned one
    flat = {"position_embedding_type": "rope", "max_sequence_length": 64, "hidden_size": 32}
    assert GPT.architecture_conflicts(flat, {**flat, "max_sequence_length": 32}) == []
    assert GPT.architecture_conflicts({"max_sequence_length": 64}, {**flat, "max_sequence_length": 32}) == []
    gpt2 = {**flat, "position_embedding_type": "learned_absolute"}
    assert GPT.architecture_conflicts(gpt2, {**gpt2, "max_sequence_length": 32}) == [("max_sequence_length", 64, 32)]
    # switching the kind of positions is no longer context: both are reported
    assert [k for k, _, _ in GPT.architecture_conflicts(flat, {**gpt2, "max_sequence_length": 32})] == [
        "max_sequence_length", "position_embedding_type"]


def test_a_checkpoint_that_does_not_fit_names_the_run_s_own_configuration(tmp_path):
    """A run started from a Hugging Face folder predicted with the recipe the docs show (`predict --config
    recipes/gpt_tiny.yaml --ckpt_path RUN/checkpoints/last.ckpt`) was refused with the differing values only: the
    configuration the CLI saved in the run's folder is named as the way to build the model that fits."""
    from lightning_megatron.checkpoint import does_not_fit

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.mkdir(parents=True)
    message = str(does_not_fit(ckpt, {"tp": 1}, ["config.hidden_size: checkpoint 64, model 128"]))
    assert message.endswith("Build the model with the checkpoint's values (the first of each pair) to load it"), message
    saved = tmp_path / "run" / "csv" / "version_0" / "config.yaml"  # where it goes with the recipes' CSV logger
    saved.parent.mkdir(parents=True)
    saved.write_text("model: {}\n")
    message = str(does_not_fit(ckpt, {"tp": 1}, ["config.hidden_size: checkpoint 64, model 128"]))
    assert message.endswith(f"to load it, e.g. with the run's own configuration: --config {saved}"), message
