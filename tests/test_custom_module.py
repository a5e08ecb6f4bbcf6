"""A user-written LightningModule (not BERT) that follows the documented contract
(``lightning_megatron.protocols.MegatronModule``) trains under TP=2 and PP=2 exactly as on one process.

``CharModel`` below was written from the public docs only (protocols.py's docstrings,
docs/tensor_parallel.md, docs/pipeline.md, docs/strategy.md): a tiny character-level next-token
model, an embedding on the first pipeline stage, residual blocks of ColumnParallelLinear -> GELU ->
RowParallelLinear split over the stages, and a vocab-parallel head with
``vocab_parallel_cross_entropy`` on the last stage. ``CharLightningModule`` is the same model on the
model-agnostic base (``lightning_megatron.module.MegatronLightningModule``), trained through
``lightning-megatron fit --model.class_path ...`` and proven at TP=2 and PP=2 by ``lightning-megatron
check``, without importing BERT.
"""

from __future__ import annotations

import contextlib
import json
import os
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import accelerator, run_distributed, run_python

from lightning_megatron.callbacks import OptimizerParamSchedulerCallback
from lightning_megatron.module import MegatronLightningModule
from lightning_megatron.pipeline import stage_chunks
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from lightning_megatron.replica_check import ReplicaGradientError
from lightning_megatron.tensor_parallel.param_facts import param_facts, set_param_facts

# Lightning warns that validation_step has no val_dataloader during fit (validation is run explicitly)
pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")

VOCAB, HIDDEN, FFN, BLOCKS, SEQ = 16, 16, 64, 4, 8
GLOBAL_BATCH, MICRO, STEPS, LR = 8, 2, 4, 0.5


@contextlib.contextmanager
def seeded(name: str):
    """The default RNG seeded from a stable name, restored afterwards: whichever rank builds a piece
    draws the same full weights, and the parallel layers keep their slice (layout-independent init)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(name.encode()))
        yield


class Block(nn.Module):
    """x + fc2(gelu(fc1(x))): fc1 column-parallel (ffn split), fc2 row-parallel (one all-reduce)."""

    def __init__(self, tp_group) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, tp_group=tp_group)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, tp_group=tp_group, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h]
        h, _ = self.fc1(x)
        y, _ = self.fc2(F.gelu(h))
        return x + y


class Chunk(nn.Module):
    """One pipeline piece: the embedding if it is the first, its blocks (keyed by global block
    number, so parameter names do not depend on the layout), the head if it is the last."""

    def __init__(self, layers: range, pre_process: bool, post_process: bool, tp_group, vocab_size: int = VOCAB) -> None:
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor: torch.Tensor | None = None
        if pre_process:
            with seeded("embed"):
                self.embed = nn.Embedding(vocab_size, HIDDEN)
        self.blocks = nn.ModuleDict()
        for i in layers:
            with seeded(f"blocks.{i}"):
                self.blocks[str(i)] = Block(tp_group)
        if post_process:
            with seeded("head"):   # logits split by vocabulary: [s, b, VOCAB / t]
                self.head = ColumnParallelLinear(HIDDEN, vocab_size, tp_group=tp_group)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor   # the previous stage's output (None on the first piece)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(0, 1) if self.pre_process else self.input_tensor  # [s, b, h]
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)[0] if self.post_process else x


class CharModel(LightningModule):
    """Next-token prediction on character sequences, following the MegatronModule contract."""

    def configure_model(self) -> None:
        if hasattr(self, "model_chunks"):   # Lightning calls it again in every fit/validate/...
            return
        ps = self.trainer.strategy.parallel_state
        self.tp_group = ps.tp_group
        self.model_chunks = nn.ModuleList(
            Chunk(c.layers, c.pre_process, c.post_process, ps.tp_group)
            for c in stage_chunks(BLOCKS, ps.pp_size, ps.pp_rank, ps.vp_size))

    def forward_step(self, microbatch, chunk):
        tokens, targets = microbatch                  # [b, s] each
        output = chunk(tokens)
        if not chunk.post_process:
            return output, None                       # hidden states for the next stage

        def loss_func(logits):                        # [s, b, VOCAB / t]
            loss = vocab_parallel_cross_entropy(logits, targets.t(), tp_group=self.tp_group).mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    def pipeline_tensor_shape(self, microbatch):
        tokens, _ = microbatch
        return (tokens.shape[1], tokens.shape[0], HIDDEN)   # [s, b, h]

    def sharded_named_parameters(self):
        for chunk in self.model_chunks:
            yield from chunk.named_parameters()       # embed.weight, blocks.3.fc1.weight, head.weight...

    # Lightning's Trainer refuses a module without training_step (and trainer.validate one without
    # validation_step); under MegatronStrategy they are never called: forward_step serves every stage.
    def training_step(self, batch, batch_idx):
        raise AssertionError("MegatronStrategy runs forward_step, never training_step")

    def validation_step(self, batch, batch_idx):
        raise AssertionError("MegatronStrategy runs forward_step, never validation_step")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class LocalNames(CharModel):
    """A newcomer's mistake: each stage names its blocks by their place on the stage (``blocks.0`` on every stage),
    not by their global number."""

    def sharded_named_parameters(self):
        for chunk in self.model_chunks:
            local = {key: str(i) for i, key in enumerate(chunk.blocks)}
            for name, p in chunk.named_parameters():
                parts = name.split(".")
                if parts[0] == "blocks":
                    parts[1] = local[parts[1]]
                yield ".".join(parts), p


class ScaledLogits(CharModel):
    """CharModel with a learned scale of its logits: a user's parameter outside the parallel layers, replicated
    over TP, applied to the vocab-parallel logits, so that each TP rank computes a part of its gradient. With
    ``mark``, declared as such (``set_param_facts(..., sequence_parallel=True)``: its gradient summed over TP)."""

    mark = False

    def configure_model(self) -> None:
        if hasattr(self, "model_chunks"):
            return
        super().configure_model()
        for chunk in self.model_chunks:
            if chunk.post_process:
                chunk.logit_scale = nn.Parameter(torch.tensor(1.5))
                if self.mark:
                    set_param_facts(chunk.logit_scale, sequence_parallel=True)

    def forward_step(self, microbatch, chunk):
        output, loss_func = super().forward_step(microbatch, chunk)
        return (output * chunk.logit_scale if chunk.post_process else output), loss_func


class MarkedScaledLogits(ScaledLogits):
    mark = True


class SequenceSplitChunk(nn.Module):
    """The whole model on one stage, its activations split along the sequence over TP between the parallel layers
    (sequence parallelism written by hand): the embedding's output scattered, a block whose fc1 gathers the
    sequence and fc2 reduce-scatters it, the head gathering it. A replicated parameter of the user's, a learned
    per-feature ``scale`` before fc1, sees only this rank's piece of the sequence (the embedding before the
    scatter sees all of it: the scatter's backward gathers its gradient)."""

    def __init__(self, tp_group) -> None:
        super().__init__()
        self.pre_process = self.post_process = True
        self.tp_group = tp_group
        with seeded("embed"):
            self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.scale = nn.Parameter(torch.ones(HIDDEN))
        with seeded("blocks.0"):
            self.fc1 = ColumnParallelLinear(HIDDEN, FFN, tp_group=tp_group, sequence_parallel=True)
            self.fc2 = RowParallelLinear(FFN, HIDDEN, tp_group=tp_group, input_is_parallel=True, sequence_parallel=True)
        with seeded("head"):
            self.head = ColumnParallelLinear(HIDDEN, VOCAB, tp_group=tp_group, sequence_parallel=True)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        pass

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = scatter_to_sequence_parallel_region(self.embed(tokens).transpose(0, 1), self.tp_group)  # [s/t, b, h]
        h, _ = self.fc1(x * self.scale)
        y, _ = self.fc2(F.gelu(h))
        return self.head(x + y)[0]  # [s, b, VOCAB / t]


class SequenceSplit(CharModel):
    def configure_model(self) -> None:
        if hasattr(self, "model_chunks"):
            return
        self.tp_group = self.trainer.strategy.parallel_state.tp_group
        self.model_chunks = nn.ModuleList([SequenceSplitChunk(self.tp_group)])


class CharLightningModule(MegatronLightningModule):
    """CharModel on the model-agnostic base: only the chunks, the forward step and the stage shape. Its
    ``vocab_size`` has a default, as a user writes it (``check`` keeps it; the datamodule has none)."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        super().__init__()
        self.save_hyperparameters()

    def build_chunks(self, ps):                       # the strategy's ParallelState (one process without it)
        return [Chunk(c.layers, c.pre_process, c.post_process, ps.tp_group, self.hparams.vocab_size)
                for c in stage_chunks(BLOCKS, ps.pp_size, ps.pp_rank, ps.vp_size)]

    def forward_step(self, microbatch, chunk):
        tokens, targets = microbatch
        output = chunk(tokens)
        if not chunk.post_process:
            return output, None
        tp_group = self.parallel_state.tp_group

        def loss_func(logits):
            loss = vocab_parallel_cross_entropy(logits, targets.t(), tp_group=tp_group).mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    def pipeline_tensor_shape(self, microbatch):
        tokens, _ = microbatch
        return (tokens.shape[1], tokens.shape[0], HIDDEN)

    def default_optimizer(self, param_groups):
        return torch.optim.SGD(param_groups, lr=LR)


class CharDataModule(LightningDataModule):
    """``char_data()`` in global batches; the batch sizes the strategy reads from a datamodule."""

    def __init__(self, global_batch_size: int = GLOBAL_BATCH, micro_batch_size: int = MICRO) -> None:
        super().__init__()
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size

    def train_dataloader(self):
        return DataLoader(char_data(), batch_size=self.global_batch_size)


class LossLog(Callback):
    """The loss of every step (for the CLI run below)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def char_data() -> TensorDataset:
    """Sequences t, t+k, t+2k, ... (mod VOCAB): the next character depends on the last two."""
    g = torch.Generator().manual_seed(0)
    n = GLOBAL_BATCH * STEPS
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + step * torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def shards(module: CharModel) -> dict:
    """This rank's parameters under their checkpoint names, with how they are split over TP."""
    return {name: (p.detach().cpu().clone(), param_facts(p).tensor_model_parallel, param_facts(p).partition_dim)
            for name, p in module.sharded_named_parameters()}


class Record(Callback):
    """The initial parameters and the loss of every step (the mean over the global batch)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.init: dict = {}

    def on_train_start(self, trainer, pl_module):
        self.init = shards(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def make_trainer(tp: int, pp: int, devices: int, **kwargs) -> Trainer:
    return Trainer(accelerator=accelerator(), devices=devices, max_steps=STEPS, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   strategy=MegatronStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             micro_batch_size=MICRO), **kwargs)


def fit(tp: int, pp: int, devices: int, save_to: str | None = None, validate: bool = False,
        module_class: type = CharModel) -> dict:
    """Train STEPS steps at this layout (then save a checkpoint, or validate): the per-step losses,
    this rank's parameter shards (initial and final) and the validation loss."""
    module, rec = module_class(), Record()
    data = DataLoader(char_data(), batch_size=GLOBAL_BATCH)
    t = make_trainer(tp, pp, devices, callbacks=[rec])
    t.fit(module, data)
    if save_to is not None:
        t.save_checkpoint(save_to)
    out = {"losses": rec.losses, "init": rec.init, "shards": shards(module),
           "tp_rank": t.strategy.parallel_state.tp_rank}
    if validate:
        out["val_loss"] = float(t.validate(module, data, verbose=False)[0]["val_loss"])
    return out


class PlainPredictor(LightningModule):
    """A plain module (no forward_step) that predicts; a module's arguments have defaults."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, 2)

    def predict_step(self, batch, batch_idx):
        return self.lin(batch)


def _two_rank_worker(ckpt_dir: str) -> dict:
    # predict from Python with a plain loader at DP=2: Lightning's unrepeated sampler gives the ranks 2 and 1 of the 3
    # rows, and they stop at different batches. The stop signals' agreement at each batch of an evaluation waited on
    # rank 0's second batch for a rank that had ended (until the collective timeout); the ranks compare their batch
    # counts once and agree at each batch only where they are the same.
    rows = [torch.full((4,), float(i)) for i in range(3)]
    t = Trainer(accelerator=accelerator(), devices=2, logger=False, enable_progress_bar=False,
                enable_model_summary=False, strategy=MegatronStrategy(micro_batch_size=1))
    out = {"uneven_predict": len(t.predict(PlainPredictor(), DataLoader(rows, batch_size=1)))}
    out.update({"tp2": fit(2, 1, 2, f"{ckpt_dir}/tp2"), "pp2": fit(1, 2, 2, f"{ckpt_dir}/pp2")})
    try:
        fit(1, 2, 2, module_class=LocalNames)
    except ValueError as e:
        out["local_names"] = str(e)
    try:  # a replicated parameter that gets part of its gradient on each TP rank: refused at the first step
        fit(2, 1, 2, module_class=ScaledLogits)
    except ReplicaGradientError as e:
        out["partial_grad"] = str(e)
    out["marked"] = fit(2, 1, 2, module_class=MarkedScaledLogits)
    try:  # the same under sequence parallelism: replicated parameters on a piece of the sequence
        fit(2, 1, 2, module_class=SequenceSplit)
    except ReplicaGradientError as e:
        out["sequence_split"] = str(e)
    # Each node runs its own command: one started with another layout or another lr (a node's edited recipe) hung
    # in the group set-up for the 30-minute timeout, or trained on with each rank's own schedule, unsaid.
    rank = dist.get_rank()
    for name, tp, max_lr in (("other_tp", 2 - rank, 1e-3), ("other_lr", 1, 1e-3 * (1 + 4 * rank))):
        module, data = CharModel(), DataLoader(char_data(), batch_size=GLOBAL_BATCH)
        try:
            make_trainer(tp, 1, 2, callbacks=[OptimizerParamSchedulerCallback(max_lr=max_lr)]).fit(module, data)
        except ValueError as e:
            out[name] = str(e)
    return out


def _one_process(ckpt_dir: str) -> dict:
    """The reference: train on one process, then load each two-rank checkpoint into a fresh module
    and validate it."""
    out = fit(1, 1, 1, validate=True)
    out["marked"] = fit(1, 1, 1, module_class=MarkedScaledLogits)
    data = DataLoader(char_data(), batch_size=GLOBAL_BATCH)
    for layout in ("tp2", "pp2"):
        module = CharModel()
        [metrics] = make_trainer(1, 1, 1).validate(module, data, ckpt_path=f"{ckpt_dir}/{layout}", verbose=False)
        out[f"loaded_{layout}"] = {"shards": shards(module), "tp_rank": 0, "val_loss": float(metrics["val_loss"])}
    return out


def full_params(ranks: list[dict], key: str = "shards") -> dict[str, torch.Tensor]:
    """Global parameters: TP shards concatenated along their partition dim, stages merged by name."""
    pieces: dict[str, list] = {}
    for r in sorted(ranks, key=lambda r: r["tp_rank"]):
        for name, (value, parallel, dim) in r[key].items():
            pieces.setdefault(name, []).append((value, parallel, dim))
    out = {}
    for name, ps in pieces.items():
        value, parallel, dim = ps[0]
        out[name] = torch.cat([v for v, _, _ in ps], dim) if parallel else value
    return out


@contextlib.contextmanager
def hermetic():
    """Run a one-process Trainer in the pytest process and leave nothing behind: the environment
    (Lightning sets MASTER_PORT etc.; a module-scoped fixture runs before conftest's snapshot), the
    RNG, the thread count and the process group."""
    env, threads = dict(os.environ), torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    r0, r1 = run_distributed(_two_rank_worker, 2, ckpt_dir, timeout=240)
    with hermetic():   # in this process: a spawn would only add start-up time
        ref = _one_process(ckpt_dir)
    return {"ref": ref, "tp2": [r0["tp2"], r1["tp2"]], "pp2": [r0["pp2"], r1["pp2"]],
            "local_names": [r.get("local_names") for r in (r0, r1)], "ranks": [r0, r1]}


def test_a_predict_whose_ranks_read_different_numbers_of_batches_ends_on_every_rank(runs):
    assert [r["uneven_predict"] for r in runs["ranks"]] == [2, 1]


def test_ranks_started_with_other_settings_are_refused_at_setup(runs):
    """Every rank compares what it was started with (the layout, the module's and the data's hyper-parameters, the
    Megatron callbacks' settings, the Trainer's) with rank 0's at set-up, before the groups are made: a difference
    is named on every rank, rather than a hang in the group set-up or a run whose ranks train different things."""
    for rank, r in enumerate(runs["ranks"]):
        tp = r.get("other_tp")
        assert tp is not None and tp.startswith("MegatronStrategy: the ranks were started with different settings"), tp
        assert "strategy.tensor_model_parallel_size: rank 1 has 1, rank 0 has 2" in tp, tp
        lr = r.get("other_lr")
        assert lr is not None and "OptimizerParamSchedulerCallback.max_lr: rank 1 has 0.005, rank 0 has 0.001" in lr, lr
        assert "every node must run the same command" in lr, lr


def test_a_name_on_two_pipeline_stages_is_refused_at_setup(runs):
    """Two stages whose parameters share a name (blocks keyed by their place on the stage): a checkpoint stores one
    tensor a name, so one stage's blocks were silently lost at the save and the other's loaded on both at resume
    (losses after the resume off in the 3rd digit, no error). Refused on every rank at set-up, before a step."""
    for message in runs["local_names"]:
        assert message is not None and message.startswith(
            "MegatronStrategy: parameter name 'blocks.0.fc1.weight' is on pipeline stages 0 and 1"), message


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_custom_module_equals_one_process(runs, layout):
    """Per-step losses within 1e-5 relative on every rank, and the final global weights within 1e-5,
    of one process; every weight moved and the loss fell."""
    ref = runs["ref"]
    assert len(ref["losses"]) == STEPS
    assert ref["losses"][-1] < ref["losses"][0] - 0.1, f"the reference must learn: {ref['losses']}"
    ranks = runs[layout]
    for r in ranks:   # every rank (both stages under PP) logs the global batch's loss
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    # the initial weights are layout-independent: TP shards are slices of one process's weights
    init = full_params([ref], "init")
    for name, value in full_params(ranks, "init").items():
        assert torch.equal(value, init[name]), f"{name}: initial weights depend on the layout"
    got, want = full_params(ranks), full_params([ref])
    assert got.keys() == want.keys() == init.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert (want[name] - init[name]).abs().max() > 1e-4, f"{name} did not train"


def test_a_replicated_parameter_with_part_of_its_gradient_on_each_rank_is_refused_at_the_first_step(runs):
    """A learned scale of the vocab-parallel logits (a user's parameter the parallel layers know nothing of) got
    each TP rank's part of its gradient (0.16 and 0.09 of 0.25 in the audit), its copies drifting apart from
    the first step, unsaid. Refused on every rank at the first step, before the optimizer, naming it and the fix;
    declared with ``set_param_facts(..., sequence_parallel=True)`` it trains as on one process."""
    for r in runs["ranks"]:
        message = r.get("partial_grad")
        assert message is not None and message.startswith(
            "parameter 'logit_scale' (shape ()) is replicated over the 2 tensor-parallel ranks but got different "
            "gradients on them at the first step (elements differ by up to "), message
        assert "set_param_facts(param, sequence_parallel=True)" in message, message
        message = r.get("sequence_split")
        assert message is not None and message.startswith(  # (the embedding's gradient is gathered whole: fine)
            "parameter 'scale' (shape (16,)) is replicated over the 2 tensor-parallel ranks but got different "
            "gradients on them at the first step"), message
        assert "as did" not in message and "a piece of the sequence" in message, message
    ref = runs["ref"]["marked"]
    for r in runs["ranks"]:
        marked = r["marked"]
        torch.testing.assert_close(torch.tensor(marked["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        got, want = marked["shards"]["logit_scale"][0], ref["shards"]["logit_scale"][0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert abs(float(want) - 1.5) > 1e-3, "the scale trained"


class HalfDone(LightningModule):
    """Chunks and forward_step, but neither pipeline_tensor_shape nor sharded_named_parameters."""

    def configure_model(self) -> None:
        self.model_chunks = nn.ModuleList([Chunk(range(BLOCKS), True, True, None)])

    def forward_step(self, microbatch, chunk):
        raise AssertionError("refused before any step")

    def training_step(self, batch, batch_idx):
        raise AssertionError("refused before any step")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def test_partial_contract_is_refused_at_setup_naming_what_is_missing():
    """Implementing part of MegatronModule is a TypeError at set-up that names the missing members
    (even without pipelining, where a plain LightningModule would be accepted)."""
    rec = Record()
    trainer = Trainer(accelerator=accelerator(), devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[rec],
                      strategy=MegatronStrategy(micro_batch_size=MICRO))
    with pytest.raises(TypeError, match="missing: pipeline_tensor_shape, sharded_named_parameters") as e:
        trainer.fit(HalfDone(), DataLoader(char_data(), batch_size=GLOBAL_BATCH))
    assert "HalfDone" in str(e.value) and "it implements part of it" in str(e.value), str(e.value)
    assert rec.losses == [] and rec.init == {}, "refused before training started"


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_checkpoint_of_custom_module_loads_at_one_process(runs, layout):
    """Saved at TP=2 / PP=2 under the sharded_named_parameters names, loaded at TP=1 PP=1: the same
    global weights, bit for bit, and the validation loss of the one-process trained model."""
    saved, loaded = full_params(runs[layout]), runs["ref"][f"loaded_{layout}"]
    restored = full_params([loaded])
    assert restored.keys() == saved.keys()
    for name in saved:
        assert torch.equal(restored[name], saved[name]), name
    ref = runs["ref"]
    assert ref["val_loss"] < ref["losses"][0] - 0.1, "validation runs the trained model"
    torch.testing.assert_close(loaded["val_loss"], ref["val_loss"], rtol=1e-5, atol=0)


_CLI_RUN = """
import json, sys
from lightning_megatron.cli import main
from lightning_megatron.cli_lightning import lightning_cli
cli = lightning_cli(["fit", "--config", sys.argv[1], "--trainer.callbacks+=test_custom_module.LossLog"])
[log] = [c for c in cli.trainer.callbacks if type(c).__name__ == "LossLog"]
import torch
from test_custom_module import CharLightningModule
cli.trainer.save_checkpoint("char.ckpt")  # the strategy's sharded checkpoint directory, hparams as the CLI left them
loaded = dict(CharLightningModule.load_from_checkpoint("char.ckpt").sharded_named_parameters())
trained = dict(cli.model.sharded_named_parameters())
reloaded = sorted(loaded) == sorted(trained) and all(torch.equal(loaded[n], p) for n, p in trained.items())
try:
    main(["check", "--config", sys.argv[1], "--layouts", "tp2,pp2", "--steps", "2"])
except SystemExit as e:
    code = e.code
print(json.dumps({"losses": log.losses, "check_exit": code, "model": type(cli.model).__name__, "reloaded": reloaded,
                  "bert_imported": sorted(m for m in sys.modules if m.startswith("lightning_megatron.models"))}))
"""


def test_any_module_fits_and_checks_through_the_cli(tmp_path):
    """``fit`` and ``check`` of the char-level module named by class path in a recipe: it trains (the
    loss falls), ``check`` proves TP=2 and PP=2 equal one process, the base's ``load_from_checkpoint``
    rebuilds it from its checkpoint, and BERT is never imported."""
    recipe = tmp_path / "char.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        model:
          class_path: test_custom_module.CharLightningModule
        data:
          class_path: test_custom_module.CharDataModule
          init_args: {{global_batch_size: {GLOBAL_BATCH}, micro_batch_size: {MICRO}}}
        trainer:
          accelerator: cpu
          devices: 1
          strategy: megatron
          max_steps: {STEPS}
          logger: false
          enable_checkpointing: false
          enable_progress_bar: false
          enable_model_summary: false
          default_root_dir: {tmp_path}
        """))
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    done = run_python(["-c", _CLI_RUN, str(recipe)], tmp_path, env, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["model"] == "CharLightningModule"
    assert len(result["losses"]) == STEPS and result["losses"][-1] < result["losses"][0] - 0.1, result
    assert result["check_exit"] == 0, out
    for layout in ("tp2", "pp2"):
        assert f"{layout:<14} PASS" in done.stdout, out
    assert "MegatronStrategy: world 1 = TP 1 x PP 1 x DP 1" in out, "the strategy says what it resolved"
    assert result["bert_imported"] == [], result
    assert result["reloaded"], "load_from_checkpoint of the base rebuilds the trained module from its checkpoint"

