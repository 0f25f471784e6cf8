"""The data every experiment trains on, all of it shipped with Python (nothing is downloaded).

Text (``load_text``), two corpora cut at ``max_chars``: ``docs+code``, Python's documentation
topics (``pydoc_data.topics.topics``, about 0.46 M characters) followed by the standard library's
top-level ``.py`` sources in sorted order; ``docstrings``, English prose only (about 0.73 M
characters): the docstrings of the standard library's package sources. The
vocabulary is fixed (tab, newline, printable ASCII, one "other" token), so token ids do not depend
on the corpus. The train/validation split is by contiguous chunks (every ``val_every``-th chunk of
``chunk_chars`` characters is validation), so both halves mix documentation and code in
``docs+code``. ``frequent_char_ids`` re-encodes the text into a small vocabulary of its most
frequent characters, for models whose full Hessian must fit in memory.

Hierarchy: every class reachable by importing the standard library's modules, with the is-a
relation closed through ``__mro__`` (``stdlib_hierarchy``), for Poincaré embeddings.
"""

from __future__ import annotations

import ast
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import torch

# tab, newline, printable ASCII; everything else maps to one extra token
VOCAB = "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB) + 1
OTHER = len(VOCAB)


def stdlib_sources() -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted by name (a fixed list per Python version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{root}: no standard-library .py sources found; this Python ships none")
    return files


def documentation_text() -> str:
    """Python's documentation topics (``pydoc_data.topics.topics``), concatenated in key order."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


# package folders left out of the docstring corpus: tests, and tools rather than library code
_DOCSTRING_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "pydoc_data", "site-packages"}


def package_sources() -> list[Path]:
    """The standard library's ``.py`` files inside its packages (not the top-level modules, which the
    default corpus reads), without tests and tools, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.glob("*/**/*.py"):
        parts = p.relative_to(root).parts
        if not (set(parts[:-1]) & _DOCSTRING_SKIP or any(x.startswith("test") for x in parts)):
            files.append(p)
    return sorted(files)


def docstrings(path: Path) -> list[str]:
    """Module, class and function docstrings of one source file in the order ``ast.walk`` visits them
    (breadth first); none for a file that does not parse."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for n in ast.walk(tree) if isinstance(n, kinds) and (d := ast.get_docstring(n))]


DEFAULT_CORPUS = "docs+code"
CORPORA = (DEFAULT_CORPUS, "docstrings")


def load_text(max_chars: int, corpus: str = DEFAULT_CORPUS) -> str:
    """``max_chars`` characters of one corpus.

    ``docs+code``: documentation topics (sorted by key), then the top-level stdlib sources (sorted
    by name). ``docstrings``: English prose only, the docstrings of the stdlib's package sources
    (``package_sources``), separated by blank lines: no code and no text shared with ``docs+code``.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {CORPORA}")

    def documents():
        if corpus == "docstrings":
            for path in package_sources():
                for doc in docstrings(path):
                    yield doc + "\n\n"
            return
        yield documentation_text()
        for path in stdlib_sources():
            yield path.read_text(encoding="utf-8", errors="replace")

    parts, total = [], 0
    for doc in documents():
        take = doc[: max_chars - total]
        parts.append(take)
        total += len(take)
        if total >= max_chars:
            break
    return "".join(parts)


def encode(text: str) -> torch.Tensor:
    """Characters to token ids (int64) in the fixed vocabulary."""
    table = np.full(0x110000, OTHER, dtype=np.int64)
    table[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return torch.from_numpy(table[codepoints])


def decode(ids) -> str:
    return "".join(VOCAB[i] if i < len(VOCAB) else "\ufffd" for i in torch.as_tensor(ids).tolist())


def split(ids: torch.Tensor, chunk_chars: int = 4096, val_every: int = 10):
    """Contiguous chunks; every ``val_every``-th chunk (the last of each group) goes to validation."""
    chunks = torch.split(ids, chunk_chars)
    train = [c for i, c in enumerate(chunks) if i % val_every != val_every - 1]
    val = [c for i, c in enumerate(chunks) if i % val_every == val_every - 1]
    if not val:
        raise ValueError(f"corpus of {ids.numel()} chars is too short for a validation split "
                         f"({val_every} chunks of {chunk_chars} needed); raise max_chars")
    return torch.cat(train), torch.cat(val)


def load_splits(max_chars: int, chunk_chars: int = 4096, val_every: int = 10, corpus: str = DEFAULT_CORPUS):
    return split(encode(load_text(max_chars, corpus)), chunk_chars, val_every)


def get_batch(data: torch.Tensor, batch: int, block: int, generator: torch.Generator):
    """Random windows of ``block + 1`` tokens: inputs and next-token targets."""
    starts = torch.randint(0, data.numel() - block - 1, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(block + 1)
    windows = data[idx]
    return windows[:, :-1], windows[:, 1:]


def eval_windows(data: torch.Tensor, n: int, block: int):
    """``n`` evenly spaced windows over ``data``: the same validation set for every run."""
    starts = torch.linspace(0, data.numel() - block - 2, n).long()
    windows = data[starts[:, None] + torch.arange(block + 1)]
    return windows[:, :-1], windows[:, 1:]


def frequent_char_ids(text: str, vocab: int) -> tuple[torch.Tensor, list[str]]:
    """``text`` as ids of its ``vocab - 1`` most frequent characters; id ``vocab - 1`` is every other one."""
    if vocab < 2:
        raise ValueError(f"vocab={vocab}: need at least 2 symbols (one character plus 'other')")
    chars = [c for c, _ in Counter(text).most_common(vocab - 1)]
    table = np.full(0x110000, vocab - 1, dtype=np.int64)
    table[[ord(c) for c in chars]] = np.arange(len(chars))
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return torch.from_numpy(table[codepoints]), chars + ["<other>"]


# ----------------------------------------------------------------------- class hierarchy
# Run in a fresh interpreter so module side effects (signal handlers, printing) stay out of ours.
_HIERARCHY_CODE = r'''
import contextlib, importlib, io, json, pkgutil, sys, warnings
warnings.simplefilter("ignore")
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3",
        "ensurepip", "pydoc_data", "xxsubtype", "xxlimited"}
def load(name):
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return importlib.import_module(name)
    except BaseException:
        return None
mods = []
for n in sys.argv[1:] or sorted(sys.stdlib_module_names):
    if n in SKIP or n.startswith("_"):
        continue
    m = load(n)
    if m is None:
        continue
    mods.append(m)
    for info in pkgutil.walk_packages(getattr(m, "__path__", None) or [], n + "."):
        parts = info.name.split(".")[1:]
        if any(p in SKIP or p in ("tests", "test") or p.startswith("_") for p in parts):
            continue
        sub = load(info.name)
        if sub is not None:
            mods.append(sub)
seen = {}
for m in mods:
    for obj in list(vars(m).values()):
        if isinstance(obj, type):
            for c in obj.__mro__:
                seen[id(c)] = c
name = lambda c: f"{c.__module__}.{c.__qualname__}"
edges = sorted({(name(c), name(a)) for c in seen.values() for a in c.__mro__[1:]})
print("\nRESULT " + json.dumps({"modules": len(mods), "python": sys.version.split()[0], "edges": edges}), flush=True)
'''


def stdlib_hierarchy(timeout=600, modules=None):
    """(names, edges (E, 2) child->ancestor index pairs, info) of the stdlib's is-a closure.

    Modules with side effects (``antigravity``, ``this``, ``turtle``, ...) and test packages are
    skipped; modules that fail to import are dropped. ``modules``: import only these (and their
    submodules) instead of the whole standard library.
    """
    from experiments.harness.child import run_child

    # -I: the child imports the standard library only (no site-packages, no checkout), and prints
    # the result line as experiments/harness/child.py's emit_result does
    run = run_child([sys.executable, "-I", "-c", _HIERARCHY_CODE, *(modules or [])], timeout=timeout)
    data = run.check("collecting the class hierarchy").result
    names = sorted({n for e in data["edges"] for n in e})
    index = {n: i for i, n in enumerate(names)}
    edges = torch.tensor([[index[a], index[b]] for a, b in data["edges"]], dtype=torch.long)
    return names, edges, {"modules": data["modules"], "python": data["python"]}


def related_matrix(n, edges):
    """Symmetric boolean (n, n): u and v related by is-a in either direction, or u == v."""
    rel = torch.zeros(n, n, dtype=torch.bool)
    rel[edges[:, 0], edges[:, 1]] = True
    rel[edges[:, 1], edges[:, 0]] = True
    rel.fill_diagonal_(True)
    return rel
