"""docs/finetune.md runs as written: every bash and python block (but the parse-only ones, which
tests/test_docs_blocks.py parses), in order, from a scratch directory that holds the repository's
recipes (so the page's relative paths resolve as in a checkout): pretraining, a GLUE-shaped JSONL task
fine-tuned and validated through the CLI, the export."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced bash/python block of a Markdown page that is not parse-only."""
    found = re.finditer(r"(<!-- doc-test: parse-only[^>]*-->\s*\n)?```(bash|python)\n(.*?)```", page.read_text(), re.S)
    return [(m.group(2), m.group(3)) for m in found if m.group(1) is None]


def test_finetune_walkthrough_runs_as_written(tmp_path):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ["PATH"], WANDB_MODE="offline", WANDB_SILENT="true",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1")
    found = blocks(ROOT / "docs" / "finetune.md")
    assert [lang for lang, _ in found] == ["bash", "python", "bash", "bash", "python"]
    outputs = []
    for lang, code in found:
        cmd = ["bash", "-e", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, code + "\n" + proc.stdout[-3000:] + proc.stderr[-5000:]
        outputs.append(proc.stdout)
    assert "520 training rows, 129 validation rows" in outputs[1]
    assert (tmp_path / "runs" / "bert_tiny_sst2" / "checkpoints" / "last.ckpt").is_dir()
    for metric in ("val_accuracy", "val_f1", "val_matthews_corrcoef", "val_loss"):  # printed by `finetune validate`
        assert metric in outputs[2], metric
    assert (tmp_path / "runs" / "bert_tiny_hf" / "model.safetensors").is_file()
