"""Measuring another source tree of Tandem beside this one: each in its own process, in turns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure_in(tree: Path, module: str, call: str):
    """``call`` (an expression on ``module``, a module of bench/, bound to ``m``) evaluated in a process that
    imports Tandem from ``tree`` and the benchmark from this tree; its value, JSON-ready."""
    code = f"import json, {module} as m; print(json.dumps({call}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (tree, ROOT, ROOT / "bench")))}
    # -P: the working directory does not shadow PYTHONPATH; the engine is imported from ``tree``, the benchmark (and
    # the tests' helpers) from this tree.
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
