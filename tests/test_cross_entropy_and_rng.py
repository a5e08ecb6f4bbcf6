"""vocab_parallel_cross_entropy equals F.cross_entropy; RNG tracker and recompute semantics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from lightning_megatron.parallel_state import initialize_model_parallel
from lightning_megatron.parallel_dims import ParallelDims
from lightning_megatron.tensor_parallel import (
    ColumnParallelLinear,
    get_rng_tracker,
    model_parallel_seed,
    pad_vocab_size,
    recompute,
    vocab_parallel_cross_entropy,
)

TOL = dict(atol=1e-6, rtol=1e-6)


def _ce_cases(tp: int, group, rank: int) -> None:
    # vocab 5 at tp=4: 8 padded columns, the last rank holds only padding (its max is -inf)
    for vocab, smoothing, scale in [(48, 0.0, 1.0), (50, 0.0, 1.0), (50, 0.1, 1.0), (47, 0.2, 1e3), (48, 0.0, 1e3),
                                    (5, 0.1, 1.0)]:
        padded = pad_vocab_size(vocab, tp, make_vocab_size_divisible_by=1)
        torch.manual_seed(vocab + int(100 * smoothing))
        logits = torch.randn(3, 5, padded) * scale
        target = torch.randint(0, vocab, (3, 5))
        target[0, 1] = -100
        target[2, 4] = -100
        ref_logits = logits[..., :vocab].clone().requires_grad_()
        ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none",
                              label_smoothing=smoothing, ignore_index=-100).reshape(3, 5)
        dloss = torch.rand(3, 5)
        ref.backward(dloss)
        local = logits.chunk(tp, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, smoothing, tp_group=group,
                                            vocab_size=None if vocab == padded else vocab)
        loss.backward(dloss)
        torch.testing.assert_close(loss, ref, **TOL)
        full_grad = torch.zeros(3, 5, padded)
        full_grad[..., :vocab] = ref_logits.grad
        torch.testing.assert_close(local.grad, full_grad.chunk(tp, -1)[rank], **TOL)
        assert torch.isfinite(loss).all()
        # 16-bit logits: the same loss as their fp32 values (the widening is exact), the gradient in their dtype
        local16 = logits.chunk(tp, -1)[rank].bfloat16().requires_grad_()
        ref16 = logits[..., :vocab].bfloat16().float().requires_grad_()
        F.cross_entropy(ref16.reshape(-1, vocab), target.reshape(-1), reduction="none", label_smoothing=smoothing,
                        ignore_index=-100).reshape(3, 5).backward(dloss)
        loss16 = vocab_parallel_cross_entropy(local16, target, smoothing, tp_group=group,
                                              vocab_size=None if vocab == padded else vocab)
        loss16.backward(dloss)
        full16 = torch.zeros(3, 5, padded)
        full16[..., :vocab] = ref16.grad
        assert loss16.dtype == torch.float32 and local16.grad.dtype == torch.bfloat16
        torch.testing.assert_close(loss16, F.cross_entropy(ref16.detach().reshape(-1, vocab), target.reshape(-1),
                                                           reduction="none", label_smoothing=smoothing,
                                                           ignore_index=-100).reshape(3, 5), **TOL)
        torch.testing.assert_close(local16.grad, full16.chunk(tp, -1)[rank].bfloat16(), atol=1e-5, rtol=8e-3)  # 1 ulp
        # A piece of rows at a time (the CPU tuning's loss_rows): the same bits as all rows at once. 15 rows:
        # pieces of 2 leave one row over (it joins the piece before), of 4 three.
        for rows in (2, 4):
            for whole, loss_whole in ((local, loss), (local16, loss16)):
                piecewise = whole.detach().clone().requires_grad_()
                got = vocab_parallel_cross_entropy(piecewise, target, smoothing, tp_group=group, rows_per_piece=rows,
                                                   vocab_size=None if vocab == padded else vocab)
                got.backward(dloss)
                assert torch.equal(got, loss_whole) and torch.equal(piecewise.grad, whole.grad), (vocab, smoothing, rows)
    _argmax_cases(tp, group, rank)


def _argmax_cases(tp: int, group, rank: int) -> None:
    from lightning_megatron.models.bert.module import vocab_parallel_argmax

    # 48 columns in all; vocab 35 at tp=4 leaves the last rank padding only.
    for vocab, dtype in [(48, torch.float32), (41, torch.bfloat16), (35, torch.float32)]:
        torch.manual_seed(vocab)
        logits = torch.randn(4, 6, 48).to(dtype)
        logits[..., vocab:] = 100.0  # padding must never win
        local = logits.chunk(tp, -1)[rank]
        got = vocab_parallel_argmax(local, group, vocab)
        assert torch.equal(got, logits[..., :vocab].float().argmax(-1)), (vocab, dtype)


def _ce_worker(tp: int) -> None:
    ps = initialize_model_parallel(ParallelDims(tp=tp))
    _ce_cases(tp, ps.tp_group, ps.tp_rank)


def test_cross_entropy_single_process():
    _ce_cases(1, None, 0)


@pytest.mark.parametrize("tp", [2, 4], ids=lambda t: f"tp{t}")
def test_vocab_parallel_cross_entropy_equals_torch(tp):
    run_distributed(_ce_worker, tp, tp, timeout=120)


def test_cross_entropy_in_pieces_keeps_the_bits_where_a_row_sum_may_be_split_across_threads():
    """33,000 columns: more than ATen's grain, so a one-row sum would be split across threads (another order
    of additions); pieces of 2 over 9 rows end in a piece of 3, never of one. A transposed (not flattenable)
    input goes all at once, and a one-row piece is refused."""
    torch.set_num_threads(2)  # a split needs two threads (an xdist worker has one; the autouse fixture restores it)
    torch.manual_seed(0)
    # On the host whatever the test device: the pieces are the CPU kernels' (rows_per_piece, kernels.py), and
    # an accelerator's reduction kernels choose their own order of additions by the number of rows.
    cpu = torch.device("cpu")
    logits = torch.randn(9, 33_000, device=cpu) * 0.5  # fp32, a scale where one row sums its exps in another order
    target = torch.randint(0, 33_000, (9,), device=cpu)
    target[4] = -100
    dloss = torch.rand(9, device=cpu)
    results = []
    for rows, z in ((None, logits), (2, logits), (3, logits), (2, logits.view(3, 3, -1).transpose(0, 1))):
        z = z.clone() if z.is_contiguous() else z.detach()
        z.requires_grad_()
        loss = vocab_parallel_cross_entropy(z, target if z.dim() == 2 else target.view(3, 3).t(), 0.1,
                                            rows_per_piece=rows)
        loss.backward(dloss if z.dim() == 2 else dloss.view(3, 3).t())
        grad = z.grad if z.dim() == 2 else z.grad.transpose(0, 1).reshape(9, -1)
        results.append((loss if z.dim() == 2 else loss.t().reshape(9), grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
    with pytest.raises(ValueError, match="rows_per_piece=1 must be at least 2 rows"):
        vocab_parallel_cross_entropy(logits, target, rows_per_piece=1)


def test_cross_entropy_bf16_logits_give_fp32_loss_and_bf16_grad():
    logits = torch.randn(4, 10, dtype=torch.bfloat16, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.randint(0, 10, (4,)))
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def _rng_worker() -> dict:
    ps = initialize_model_parallel(ParallelDims(tp=2))
    model_parallel_seed(1234, ps.tp_rank)
    tracker = get_rng_tracker()
    x = torch.ones(64, 64)
    replicated = F.dropout(x, 0.5)  # default generator: same on every TP rank
    with tracker.fork():
        sharded = F.dropout(x, 0.5)  # model-parallel stream: differs per TP rank
    after = torch.rand(4)  # the fork must not advance the default generator

    # recompute: checkpointed dropout + column-parallel layer gives the same output and grads
    layer = ColumnParallelLinear(16, 32, tp_group=ps.tp_group)

    def block(inp):
        out, _ = layer(inp)
        with tracker.fork():
            out = F.dropout(out, 0.3)
        return F.dropout(torch.tanh(out), 0.2)

    model_parallel_seed(7, ps.tp_rank)
    inp = torch.randn(4, 16)
    a_in = inp.clone().requires_grad_()
    a = block(a_in)
    a.sum().backward()
    grads_plain = (a_in.grad.clone(), layer.weight.grad.clone())
    layer.zero_grad()
    model_parallel_seed(7, ps.tp_rank)
    _ = torch.randn(4, 16)  # same RNG consumption as above
    b_in = inp.clone().requires_grad_()
    b = recompute(block, b_in)
    torch.rand(3)  # RNG moves on before backward, recompute must still replay the forward masks
    with tracker.fork():
        torch.rand(3)
    b.sum().backward()
    assert torch.equal(a, b)
    assert torch.equal(grads_plain[0], b_in.grad)
    assert torch.equal(grads_plain[1], layer.weight.grad)
    return {"replicated": replicated, "sharded": sharded, "after": after}


def test_rng_tracker_semantics_and_recompute():
    r0, r1 = run_distributed(_rng_worker, 2, timeout=60)
    assert torch.equal(r0["replicated"], r1["replicated"])
    assert not torch.equal(r0["sharded"], r1["sharded"])
    assert torch.equal(r0["after"], r1["after"])
    again = run_distributed(_rng_worker, 2, timeout=60)
    assert torch.equal(again[0]["sharded"], r0["sharded"]), "same seed must give the same masks"


def test_a_fork_inside_a_fork_of_the_same_stream_goes_on_drawing_from_it_and_recompute_replays_it():
    """A module that forks into the model-parallel stream inside a block that forked into it already (a LoRA
    adapter's dropout under sequence parallelism, which the block runs in that stream) draws the stream's next
    numbers, not its first ones again (a second swap would restore the state the outer fork started from); and
    ``recompute`` started inside the outer fork replays the forward's masks in the backward (outside it)."""
    from lightning_megatron.tensor_parallel import RNGStatesTracker, recompute

    t = RNGStatesTracker()
    t.add("mp", 5)
    with t.fork("mp"):
        first = torch.rand(4)
        with t.fork("mp"):
            inner = torch.rand(4)
        last = torch.rand(4)
    t.reset()
    t.add("mp", 5)
    with t.fork("mp"):
        want = torch.rand(12)
    assert torch.equal(torch.cat([first, inner, last]), want)

    def drop(x):
        with t.fork("mp"):
            return F.dropout(x, 0.5)

    x = torch.ones(256, requires_grad=True)
    with t.fork("mp"):
        torch.rand(3)
        y = recompute(drop, x, tracker=t)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() * 2), "the backward's mask is the forward's"


def test_tracker_rejects_duplicates_and_unknown_names():
    from lightning_megatron.tensor_parallel import RNGStatesTracker

    t = RNGStatesTracker()
    t.add("a", 1)
    with pytest.raises(ValueError):
        t.add("b", 1)
    with pytest.raises(KeyError, match="model_parallel_seed"):
        with t.fork("missing"):
            pass


def test_the_16_bit_gradient_takes_one_pass_after_its_scaling(device):
    """The backward scales the fp32 softmax rows by the incoming gradient and writes the 16-bit gradient in that
    product: the bits of scaling in fp32 and rounding once, no [tokens, V] copy after it (the same dispatch on the
    meta device, an accelerator's stand-in). Label smoothing's shift is subtracted in place, not copied back over
    itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passes(TorchDispatchMode):
        """The ops writing [tokens, V] (or a piece of its rows), views and allocations apart."""

        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if isinstance(out, torch.Tensor) and out.shape[-1:] == (40,) and name not in (
                    "empty", "alias", "view", "slice", "detach"):
                self.names.append(name)
            return out

    torch.manual_seed(0)
    logits = (torch.randn(6, 40) * 3).bfloat16()
    target, dloss = torch.randint(0, 40, (6,)), torch.rand(6)
    for on in (device, torch.device("meta")):
        per_piece = ["sub_", "mul"]
        for rows in (None, 2):
            z = logits.to(on, copy=True).requires_grad_()
            loss = vocab_parallel_cross_entropy(z, target.to(on), 0.1, rows_per_piece=rows)
            with Passes() as passes:
                loss.backward(dloss.to(on))
            assert passes.names == ["scatter_add_"] + per_piece * (1 if rows is None else 3), (on, rows, passes.names)
            assert z.grad.dtype == torch.bfloat16
            if on.type != "meta":  # softmax - (1 - eps) onehot - eps / V, times the incoming gradient; rounded once
                g = torch.softmax(logits.float(), -1) - 0.9 * F.one_hot(target, 40) - 0.1 / 40
                torch.testing.assert_close(z.grad.cpu(), (g * dloss[:, None]).bfloat16(), atol=0, rtol=8e-3)


def test_the_recomputing_cross_entropy_equals_the_vocab_parallel_function():
    """``recomputing_cross_entropy`` (what ``compile=True`` hands the compiler at one TP rank) is torch's cross
    entropy of the real columns and the function's loss and gradient: fp32 and bf16 logits, a padded vocabulary,
    label smoothing, ignored targets; eager and compiled. What it keeps for the backward is the logits themselves and
    per-row values, no fp32 [..., V] (the function's exponentials)."""
    import torch._inductor.config as inductor_config

    from lightning_megatron.tensor_parallel.cross_entropy import recomputing_cross_entropy

    def kept(f, z, *args):
        """``f(z, *args)`` and the shapes and dtypes autograd saved for its backward."""
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                      lambda t: t):
            return f(z, *args), saved

    torch.manual_seed(0)
    target = torch.randint(0, 45, (3, 7))
    target[1, 2] = target[2, 6] = -100
    dloss = torch.rand(3, 7)
    cases = [(torch.float32, 0.0, None), (torch.float32, 0.1, 45), (torch.bfloat16, 0.0, 45),
             (torch.bfloat16, 0.2, None)]
    for dtype, smoothing, vocab in cases:
        logits = (torch.randn(3, 7, 48) * 3).to(dtype)
        results = []
        for f in (vocab_parallel_cross_entropy, recomputing_cross_entropy):
            z = logits.clone().requires_grad_()
            loss, saved = kept(lambda z: f(z, target, smoothing, vocab_size=vocab), z)
            loss.backward(dloss)
            results.append((loss, z.grad, saved))
        (want, want_grad, theirs), (got, grad, ours) = results
        real = logits[..., :vocab].float().requires_grad_()  # torch's, on the real columns' exact fp32 values
        torch_loss = F.cross_entropy(real.reshape(-1, real.size(-1)), target.reshape(-1), reduction="none",
                                     label_smoothing=smoothing, ignore_index=-100).reshape(3, 7)
        torch_loss.backward(dloss)
        torch.testing.assert_close(got, torch_loss.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad[..., :real.size(-1)].float(), real.grad,
                                   **({} if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)))
        assert ((3, 7, 48), torch.float32) in theirs, "the function keeps fp32 exponentials"
        assert [shape for shape, dtype in ours if shape[-1:] == (48,) or shape[-1:] == (vocab,)] == [(3, 7, 48)]
        assert got.dtype == torch.float32 and grad.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, want_grad, **({} if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)))
        assert not vocab or (grad[..., vocab:] == 0).all(), "the padded columns have no gradient"
        assert (grad[1, 2] == 0).all() and got[1, 2] == 0, "an ignored target"
    torch._dynamo.reset()
    with inductor_config.patch(compile_threads=1):  # no pool of compile workers on 2 cores
        z = logits.clone().requires_grad_()
        loss, saved = kept(torch.compile(recomputing_cross_entropy), z, target, 0.2)
        loss.backward(dloss)
    assert [(shape, dtype) for shape, dtype in saved if shape[-1:] == (48,)] == [((3, 7, 48), torch.bfloat16)], saved
    torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z.grad, results[0][1], rtol=8e-3, atol=1e-6)


class _FakeAccelerator:
    """An accelerator's generator as torch's device modules expose it (``get_rng_state`` / ``set_rng_state``)."""

    def __init__(self):
        self.state = torch.tensor([7], dtype=torch.uint8)

    def get_rng_state(self):
        return self.state.clone()

    def set_rng_state(self, state):
        self.state = state.clone()


def test_model_building_leaves_the_accelerator_generator_and_checkpoints_keep_it(monkeypatch):
    """On a GPU, dropout outside the tensor-parallel streams draws from the accelerator's default generator. Until
    2026-12-07 every ``seeded`` block of a model build re-seeded it (``torch.manual_seed`` seeds CUDA too: the run's
    seed had no say over it), and a checkpoint did not hold it (a resumed run's masks started over)."""
    from lightning_megatron.sharded_state import rng_state, set_rng_state
    from lightning_megatron.tensor_parallel import random as tp_random
    from lightning_megatron.transformer.utils import seeded

    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    before = torch.get_rng_state()
    with seeded(1234, "decoder.layers.3"):
        torch.rand(3)
    assert reseeded == [] and torch.equal(torch.get_rng_state(), before)  # the CPU's restored, the accelerator's kept
    fake = _FakeAccelerator()
    monkeypatch.setattr(tp_random, "_accelerator_module", lambda: fake)
    saved = rng_state()
    assert torch.equal(saved["accel"], torch.tensor([7], dtype=torch.uint8))
    fake.state = torch.tensor([9], dtype=torch.uint8)  # the generator moved on; the resume restores it
    set_rng_state(saved)
    assert torch.equal(fake.state, torch.tensor([7], dtype=torch.uint8))


def test_a_recomputed_function_of_a_frozen_input_still_trains_its_weights():
    """A recomputed block whose input needs no gradient (LoRA's frozen embedding feeding layer 0): the output had no
    graph, so its trainable weights got no gradient (``block``: the first layers' adapters stayed 0 without a word)
    or the backward failed (``uniform``: "element 0 of tensors does not require grad"). As torch's non-reentrant
    checkpoint, the replay is reached: the weights' gradients equal the plain computation's."""
    from lightning_megatron.tensor_parallel import recompute

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)  # frozen: no gradient wanted
    layer(x).square().sum().backward()
    want = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    out = recompute(layer, x)
    assert out.requires_grad
    out.square().sum().backward()
    for p, w in zip(layer.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)
    assert x.grad is None and not x.requires_grad  # the caller's tensor untouched


def test_a_recomputed_function_replays_under_the_forwards_autocast():
    """The forward under autocast (bf16 matmuls), the backward after it (plain Lightning's automatic optimization):
    the replay ran in fp32 and the gradients came from other activations (0.31 of a largest 10.6). It replays under
    the autocast the forward ran in, as torch.utils.checkpoint does: the gradients equal the plain computation's."""
    from lightning_megatron.tensor_parallel import recompute

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = layer(x).float().square().sum()
    plain.backward()
    want = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        replayed = recompute(layer, x).float().square().sum()
    replayed.backward()
    for got, w in zip([p.grad for p in layer.parameters()] + [x.grad], want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
