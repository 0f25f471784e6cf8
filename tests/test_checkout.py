"""A script of a second checkout runs that checkout's code and writes only into it.

Two copies of this working tree, A and B (each its own git repository), and a virtual environment
with A installed editable (``pip install -e A``, as requirements.txt does): a script of B must import
B's code, write its results, W&B run and caches into B, and leave every file of A as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COPIED = ["optim", "experiments", "analysis", "pyproject.toml", "README.md", ".gitignore"]


def _git(cwd, *args) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def _copy_checkout(dest: Path, message: str) -> str:
    """The working tree's files under COPIED (tracked and untracked, not ignored) in a new git
    repository at ``dest`` with one commit; returns its short hash."""
    files = _git(REPO, "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *COPIED).split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-q", "-m", message)
    return _git(dest, "rev-parse", "--short", "HEAD").strip()


def _snapshot(root: Path) -> dict:
    """Every file under ``root`` (ignored ones included), with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and ".git" not in p.relative_to(root).parts}


def _venv_with_this_environments_packages(dest: Path) -> str:
    """A new virtual environment at ``dest`` that imports the packages of the environment running the
    tests (pip, setuptools, torch, ...), whether that is a venv or the base interpreter; returns its python.

    ``--system-site-packages`` would show the base interpreter's packages, not those of a venv the
    tests run in, so the running environment's site-packages folders are listed in a ``.pth`` file
    of the new one instead: after its own site-packages, and as plain folders, so their ``.pth``
    files (an editable install of this checkout among them) are not run there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    python = str(dest / "bin" / "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    folders = site.getsitepackages() + [site.getusersitepackages()] * bool(site.ENABLE_USER_SITE)
    (Path(own) / "running_environment.pth").write_text("".join(f"{f}\n" for f in folders if os.path.isdir(f)))
    return python


@pytest.fixture(scope="module")
def two_checkouts(tmp_path_factory):
    """(python of a venv with A installed editable, A, B, B's commit, environment for its runs)."""
    if shutil.which("git") is None:
        pytest.skip("git is needed to make the two checkouts")
    tmp = tmp_path_factory.mktemp("checkouts")
    first, second = tmp / "A", tmp / "B"
    _copy_checkout(first, "first checkout")
    commit = _copy_checkout(second, "second checkout")
    python = _venv_with_this_environments_packages(tmp / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WANDB_DIR", "WANDB_MODE")}
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-e", str(first)], env=env, capture_output=True, text=True)
    assert pip.returncode == 0, f"pip install -e {first} failed:\n{pip.stdout[-2000:]}{pip.stderr[-3000:]}"
    imported = subprocess.run([python, "-c", "import experiments.harness.common as c; print(c.REPO_ROOT)"], cwd=tmp,
                              env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(imported) == first, f"the editable install should map experiments to {first}, not {imported}"
    return python, first, second, commit, env


@pytest.mark.timeout(30)
def test_the_checkouts_venv_imports_the_packages_of_the_environment_running_the_tests(two_checkouts):
    """The same torch and pip as this process, also when it runs in a venv (where the base
    interpreter's site-packages hold other versions, or none). pip's files are asked of a child of
    this interpreter too: importing pip here would leave the standard library's distutils loaded, which
    setuptools (torch.utils.cpp_extension) then refuses in later tests."""
    python, _, _, _, env = two_checkouts
    code = "import pip, torch; print(pip.__file__); print(torch.__file__)"
    seen, here = (subprocess.run([exe, "-c", code], env=env, capture_output=True, text=True, timeout=25)
                  for exe in (python, sys.executable))
    assert seen.returncode == 0 and here.returncode == 0, seen.stderr[-2000:] + here.stderr[-2000:]
    assert seen.stdout.split() == here.stdout.split()


@pytest.mark.timeout(120)
def test_a_second_checkouts_experiment_runs_its_own_code_and_leaves_the_installed_one_untouched(two_checkouts):
    python, first, second, commit, env = two_checkouts
    status_before, files_before = _git(first, "status", "--ignored", "--porcelain"), _snapshot(first)
    # run from inside A, the installed checkout: nothing may depend on the working directory either
    proc = subprocess.run([python, str(second / "experiments" / "convergence.py"), "--tiny", "--optimizers", "AdamW",
                           "--seeds", "1", "--protocol", "best", "--no-progress", "--wandb", "offline"],
                          cwd=first, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    config = json.loads((second / "results" / "quick" / "convergence.config.json").read_text())
    assert config["git_commit"].split("+")[0] == commit, config["git_commit"]
    assert config["command"].startswith("python experiments/convergence.py --tiny"), config["command"]
    assert (second / "results" / "quick" / "convergence.csv").is_file()
    assert (second / "wandb").is_dir(), "the offline W&B run should be written into the second checkout"

    assert _git(first, "status", "--ignored", "--porcelain") == status_before
    files_after = _snapshot(first)
    changed = sorted(set(files_after) ^ set(files_before)) + sorted(
        k for k in set(files_after) & set(files_before) if files_after[k] != files_before[k])
    assert not changed, f"the installed checkout was written to: {changed[:10]}"


@pytest.mark.timeout(60)
def test_a_rerun_that_still_imports_the_other_checkout_stops_naming_both_and_the_fix(two_checkouts):
    """A re-run under the second checkout that still imports the first (here: told it already was
    re-run) stops with an error instead of running the wrong code or re-running again."""
    from experiments.harness.checkout import RERUN_MARKER

    python, first, second, _, env = two_checkouts
    proc = subprocess.run([python, str(second / "analysis" / "codebook.py"), "--help"], cwd=second,
                          env=dict(env, **{RERUN_MARKER: str(second)}), capture_output=True, text=True, timeout=50)
    assert proc.returncode != 0, "the script ran with the other checkout's code:\n" + proc.stdout[-1000:]
    assert str(first) in proc.stderr and str(second) in proc.stderr, proc.stderr
    assert f"pip install --no-deps -e {second}" in proc.stderr, proc.stderr


# every script a user runs: those with a ``__main__`` block
SCRIPTS = sorted(str(p.relative_to(REPO)) for folder in ("experiments", "analysis") for p in (REPO / folder).glob("*.py")
                 if 'if __name__ == "__main__"' in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_run_without_the_repository_installed_says_how_to_install_it(tmp_path, script):
    """``python -S``: no site-packages, so neither an installed repository nor its dependencies; the
    script stops with the install command before it imports either."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-S", str(REPO / script), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert f"cd {REPO} && {sys.executable} -m pip install -e .\n" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("command", [["experiments/reproduce.py"], ["-m", "experiments.reproduce"],
                                     ["analysis/correctness.py"], ["-m", "analysis.correctness"]],
                         ids=["file", "module", "analysis-file", "analysis-module"])
def test_a_script_runs_as_a_file_or_a_module_where_the_repository_is_importable(tmp_path, command):
    """The install check passes where the packages are found (here on PYTHONPATH, as an install finds them)."""
    command = [str(REPO / command[0])] if command[0].endswith(".py") else command
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, *command, "--help"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stdout[-1000:] + proc.stderr[-2000:]
