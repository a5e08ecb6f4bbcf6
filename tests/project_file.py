"""pyproject.toml's ``[project]`` table for the tests that check what the project declares (tomllib; tomli, the
test extra's, on Python 3.10)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

try:
    import tomllib  # novm: Python 3.11
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def canonical(distribution: str) -> str:
    """A distribution's name as pip compares them (``PyYAML`` -> ``pyyaml``, ``typing_extensions`` ->
    ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def distributions(requirements: Iterable[str]) -> set[str]:
    """The canonical names of requirements such as ``jsonargparse[signatures]>=4.27`` or ``tomli; python_version <
    "3.11"``."""
    return {canonical(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}
