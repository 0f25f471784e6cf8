"""A script runs the code of the checkout it belongs to, whatever checkout is installed editable.

``pip install -e .`` maps the names ``optim``, ``experiments`` and ``analysis`` to one checkout
through a finder at the end of ``sys.meta_path``. A script of a second clone or ``git worktree``
(``python experiments/x.py`` puts only ``experiments/`` on ``sys.path``) would then import the
installed checkout's code and write its results, W&B runs and caches there. Each package's
``__init__`` calls ``use_own_checkout``: when the running script belongs to another checkout than
the package, the same command is run again with that checkout first on ``PYTHONPATH`` (entries
there come before the installed finder), so every import and every output path is the script's
own. Where that cannot work it stops with an error naming both checkouts and the fix.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Set in a re-run to the checkout it was re-run for: a second mismatch there is an error, not a loop.
RERUN_MARKER = "MEMORY_LIGHT_OPTIMIZERS_CHECKOUT"


def checkout_root(path) -> Path | None:
    """The checkout ``path`` lies in: the nearest folder above it holding ``pyproject.toml`` and the
    ``optim`` and ``experiments`` packages; None outside every checkout."""
    for folder in Path(path).resolve().parents:
        if ((folder / "pyproject.toml").is_file() and (folder / "optim" / "__init__.py").is_file()
                and (folder / "experiments" / "__init__.py").is_file()):
            return folder
    return None


def script_checkout() -> Path | None:
    """The checkout of the running script (``__main__.__file__``); None for ``python -c``, a REPL,
    or a script outside every checkout (pytest's, a user's own)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return checkout_root(main_file) if main_file else None


def mismatch_error(script: Path, package: Path, why: str) -> str:
    """The message of a run that cannot use its own checkout's code."""
    return (f"this script belongs to the checkout {script} but imports the code of the checkout {package} "
            f"(installed editable there); {why}. Make this checkout the installed one: "
            f"python -m pip install --no-deps -e {script}")


def rerun_command(script: Path) -> tuple[str, list[str], dict]:
    """Executable, arguments and environment of the same command with ``script`` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(script)] + [p for p in [env.get("PYTHONPATH")] if p])
    env[RERUN_MARKER] = str(script)
    return sys.executable, [sys.executable, *sys.orig_argv[1:]], env


def use_own_checkout(package_file) -> None:
    """Re-run the current command under the running script's own checkout when ``package_file`` (a
    package's ``__init__``) lies in another one; return at once when they agree."""
    script, package = script_checkout(), checkout_root(package_file)
    if script is None or package is None or script == package:
        return
    if sys.flags.ignore_environment:
        raise SystemExit(mismatch_error(script, package, "python -E or -I ignores PYTHONPATH, so it cannot be re-run"))
    if os.environ.get(RERUN_MARKER) == str(script):
        raise SystemExit(mismatch_error(script, package, "re-run with it first on PYTHONPATH, it still does"))
    if not sys.executable or not getattr(sys, "orig_argv", None):
        raise SystemExit(mismatch_error(script, package, "the command line to re-run it is unknown"))
    print(f"[checkout] {package} is the installed checkout; re-running with {script} first on PYTHONPATH",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    exe, argv, env = rerun_command(script)
    os.execve(exe, argv, env)
