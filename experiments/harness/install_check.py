"""Stops a script, when the repository is not installed, with the command that installs it.

``python experiments/NAME.py`` (or ``analysis/NAME.py``) puts only the script's folder on ``sys.path``:
the repository's packages (``optim``, ``experiments``, ``analysis``) are found only once installed,
since no script edits ``sys.path``. Run as a file, a script runs this file by its path
(``runpy.run_path``, standard library only) before anything else, so a missing install is one clear
message instead of a ``ModuleNotFoundError``.
"""

import importlib.util
import sys
from pathlib import Path

_MISSING = [name for name in ("optim", "experiments", "analysis") if importlib.util.find_spec(name) is None]
if _MISSING:
    _ROOT = Path(__file__).resolve().parents[2]
    raise SystemExit(
        f"{sys.argv[0]}: this repository's packages ({', '.join(_MISSING)}) are not installed in this Python "
        f"({sys.executable}). Install the repository from its checkout, then run the command again:\n"
        f"    cd {_ROOT} && {sys.executable} -m pip install -e .\n"
        "or, with the exact versions of the committed results, the README's install (section \"Install\"):\n"
        f"    cd {_ROOT} && {sys.executable} -m pip install -r requirements.txt")
