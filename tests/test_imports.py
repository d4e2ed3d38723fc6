"""The scheduler package is pure Python: importing it pulls in neither torch nor ray."""

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_scheduler_imports_neither_torch_nor_ray():
    modules = ["scheduler"] + [f"scheduler.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "scheduler")])]
    assert "scheduler.scheduler" in modules
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'numpy', 'workers', 'cluster'))\n"
        "print(json.dumps(heavy))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    assert json.loads(out.stdout) == []
