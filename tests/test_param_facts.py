"""Parameter facts are one typed record, set and read through tensor_parallel/param_facts.py only."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest
import torch

import lightning_megatron
from lightning_megatron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from lightning_megatron.tensor_parallel.param_facts import (
    ParamFacts,
    copy_param_facts,
    is_counted,
    mark_replicated,
    param_facts,
    set_param_facts,
)

PACKAGE = Path(lightning_megatron.__file__).parent
OWNER = PACKAGE / "tensor_parallel" / "param_facts.py"
FACTS = {"tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared_embedding",
         "real_vocab_size", "allreduce", "main_grad"}
"""The record's fields, Megatron's other parameter attribute, and the grad buffer's view (read from the buffer)."""
PROBES = {"getattr", "hasattr", "setattr", "delattr"}
PARAM_NAMES = {"p", "param", "parameter", "main_param", "model_param", "main", "weight"}
"""Names the package gives a parameter: probing one of these with any attribute is refused too."""


def _violations(path: Path) -> list[str]:
    out = []
    where = path.relative_to(PACKAGE) if path.is_relative_to(PACKAGE) else path.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        # getattr(p, "shared_embedding", False), hasattr(p, "main_grad"), setattr(p, name, ...) ...
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES:
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in FACTS:
                out.append(f"{where}:{node.lineno}: {node.func.id}(..., {name.value!r})")
            elif (node.func.id in ("getattr", "hasattr") and node.args and isinstance(node.args[0], ast.Name)
                  and node.args[0].id in PARAM_NAMES):
                out.append(f"{where}:{node.lineno}: {node.func.id}({node.args[0].id}, ...)")
            elif node.func.id in ("setattr", "delattr") and not isinstance(name, ast.Constant):
                out.append(f"{where}:{node.lineno}: {node.func.id} with a computed name")
        # p.shared_embedding = True (a fact assigned as a plain attribute of something other than self)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if (isinstance(t, ast.Attribute) and t.attr in FACTS - {"main_grad"}
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                    out.append(f"{where}:{t.lineno}: .{t.attr} = ...")
    return out


def test_no_parameter_attribute_probing_outside_the_owner():
    """Every fact is read with param_facts(p) and set with set_param_facts: no getattr/hasattr with a
    default that silently hides a typo or a missing mark (failed on main: 30 sites in 12 files)."""
    found = [v for path in sorted(PACKAGE.rglob("*.py")) if path != OWNER for v in _violations(path)]
    assert not found, "\n".join(found)


def test_the_probe_scan_finds_probes(tmp_path):
    """The scan above is not vacuous: each kind of probe in a file is reported."""
    bad = tmp_path / "probes.py"
    bad.write_text("def f(p, param, x):\n    getattr(p, 'shared_embedding', False)\n"
                   "    hasattr(param, '_anything')\n    x.real_vocab_size = 3\n    getattr(x, 'other', None)\n")
    assert sorted(_violations(bad)) == ["probes.py:2: getattr(..., 'shared_embedding')",
                                        "probes.py:3: hasattr(param, ...)", "probes.py:4: .real_vocab_size = ..."]


def test_the_record_is_typed_and_refused_when_missing():
    p = torch.nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(TypeError, match=r"shape \(4, 3\).*has no ParamFacts.*mark_replicated"):
        param_facts(p)
    with pytest.raises(TypeError):  # a typo is an error, not a new attribute nobody reads
        set_param_facts(p, shared_embeding=True)
    with pytest.raises(ValueError, match="partition_dim=-1"):
        ParamFacts(sharded_over=("tp",), replicated_over=())
    assert mark_replicated([p]) == 1 and param_facts(p) == ParamFacts() and mark_replicated([p]) == 0
    facts = set_param_facts(p, shared_embedding=True)
    assert param_facts(p) == facts and facts.shared_embedding and not facts.tensor_model_parallel
    main = p.detach().clone().float()
    copy_param_facts(p, main)
    assert param_facts(main) == facts
    buf = io.BytesIO()  # an fp32 main param in an optimizer state dict: its facts travel as plain values
    torch.save({"main": main}, buf)
    buf.seek(0)
    assert param_facts(torch.load(buf, weights_only=True)["main"]) == facts


def test_parallel_layers_set_their_facts():
    col = ColumnParallelLinear(4, 6, tp_group=None)
    row = RowParallelLinear(6, 4, tp_group=None, input_is_parallel=True, sequence_parallel=False)
    assert param_facts(col.weight).partition_dim == 0 and param_facts(row.weight).partition_dim == 1
    assert not param_facts(row.bias).tensor_model_parallel


@pytest.mark.parametrize("tp_rank, pp_rank, expected", [
    (0, 0, [True, True, True]), (1, 0, [True, False, True]), (0, 1, [True, True, False]), (1, 1, [True, False, False]),
])
def test_counted_once_is_one_rule(tp_rank, pp_rank, expected):
    """A shard on every TP rank, a replicated parameter on TP rank 0, the tied embedding on stage 0."""
    shard, replicated, tied = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    set_param_facts(shard, sharded_over=("tp",), replicated_over=(), partition_dim=0)
    mark_replicated([replicated])
    set_param_facts(tied, sharded_over=("tp",), replicated_over=(), partition_dim=0, shared_embedding=True)
    assert [is_counted(q, {"tp": tp_rank, "pp": pp_rank}) for q in (shard, replicated, tied)] == expected


def test_a_new_dimension_is_data_not_code():
    """An expert weight (sharded over ep, replicated over expert_tp, averaged over expert_dp) is counted,
    sliced and reduced from its facts alone: the same functions, other values."""
    expert = torch.nn.Parameter(torch.zeros(4, 3))
    facts = set_param_facts(expert, sharded_over=("ep",), replicated_over=("expert_tp",), partition_dim=0,
                            data_parallel="expert_dp")
    assert is_counted(expert, {"ep": 1, "expert_tp": 0, "tp": 1}) and not is_counted(expert, {"ep": 1, "expert_tp": 1})
    assert facts.shard({"ep": 1, "tp": 1}, {"ep": 2, "tp": 2}) == (1, 2) and not facts.tensor_model_parallel
    both = ParamFacts(sharded_over=("ep", "tp"), replicated_over=(), partition_dim=0)
    assert both.shard({"ep": 1, "tp": 1}, {"ep": 2, "tp": 2}) == (3, 4)  # ep outer, tp inner
    with pytest.raises(ValueError, match="cannot be both"):
        ParamFacts(sharded_over=("tp",), replicated_over=("tp",), partition_dim=0)
