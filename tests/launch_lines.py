"""The several-node launch lines of docs/strategy.md ("Launching"), read from the page and started as
written, with what a test must change (a free port, its own config and checkpoint) substituted and its
own settings appended: the documented lines are the ones the tests run.

A line is ``torchrun <options> -m lightning_megatron.cli ...`` (run once per simulated node) or
``for i in 0 1; do VAR=value ... lightning-megatron ... & done; wait`` (one process per value of ``i``,
each with its variables). ``torchrun`` / ``lightning-megatron`` become this interpreter's
``-m torch.distributed.run`` / ``-m lightning_megatron.cli``, so the test runs the checkout's code.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BASH = re.compile(r"```bash\n(.*?)```", re.S)
_LOOP = re.compile(r"for (\w+) in ([\w ]+); do (.*) & done; wait$")
_ASSIGN = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")


@dataclass
class Launch:
    """One process to start: its argv (after the program) and the variables set for it."""

    program: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def argv(self) -> list[str]:
        module = {"torchrun": "torch.distributed.run", "lightning-megatron": "lightning_megatron.cli"}[self.program]
        return [sys.executable, "-m", module, *self.args]

    def option(self, name: str) -> str:
        return self.args[self.args.index(name) + 1]

    def replace(self, options: dict[str, str], env: dict[str, str] | None = None) -> Launch:
        """The same launch with the values of ``options`` (``{"--config": path}``) and variables replaced;
        each must be in the line (a test changes only what the page sets)."""
        args = list(self.args)
        for name, value in options.items():
            args[args.index(name) + 1] = value
        missing = set(env or {}) - set(self.env)
        assert not missing, f"the documented line sets no {missing}"
        return Launch(self.program, args, dict(self.env, **(env or {})))


STRATEGY_SECTION = (ROOT / "docs" / "strategy.md", "**Several nodes.**")
"""Where the tested lines are: docs/strategy.md, from "Several nodes" to the next heading."""


def doc_lines(page: Path = STRATEGY_SECTION[0], section: str = STRATEGY_SECTION[1]) -> list[list[Launch]]:
    """Every command of the bash blocks from ``section`` to the next ``## `` heading of ``page``: one list
    of launches per command (a torchrun line is one launch, to start once per node; a loop is one launch
    per iteration)."""
    commands = []
    for block in bash_block_text(page, section):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                commands.append(_parse(line.strip()))
    return commands


def _parse(line: str) -> list[Launch]:
    loop = _LOOP.match(line)
    if loop is None:
        program, *args = shlex.split(line)
        return [Launch(program, args)]
    var, values, body = loop.groups()
    launches = []
    for value in values.split():
        words = shlex.split(body.replace("$" + var, value))
        env = {}
        while _ASSIGN.match(words[0]):
            k, v = _ASSIGN.match(words[0]).groups()
            env[k] = v
            words.pop(0)
        launches.append(Launch(words[0], words[1:], env))
    return launches


def bash_block_text(page: Path, section: str) -> list[str]:
    """The bash blocks of ``page`` from the text ``section`` to the next ``## `` heading, as written."""
    text = page.read_text()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    return _BASH.findall(text[start:end if end > 0 else None])


def free_port(lo: int = 20000, hi: int = 30000) -> int:
    for port in random.sample(range(lo, hi), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{lo}, {hi})")


def slurm_job_id() -> str:
    """A SLURM_JOB_ID whose port is free (Lightning's SLURMEnvironment: 15000 + the id's last 4 digits)."""
    return str(free_port(15000, 25000) - 15000 + 70000)


def environ(**extra: str) -> dict[str, str]:
    return dict(os.environ, **extra)
