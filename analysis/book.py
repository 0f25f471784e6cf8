"""The results book: results/README.md (the claims and an index) and one page a topic beside it.

Every section of the committed results lives on one page, ``results/<page>.md`` (``PAGES``); an
analysis script writes its section there, ``analysis/claims.py`` writes the claims' detail page and
the index. A page's prose is wrapped at ``WIDTH`` characters; table rows stay one line each (a
Markdown table row cannot wrap). Results anywhere else (a quick run, a test's folder) keep every
section in one ``README.md`` beside them.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

WIDTH = 110  # characters of a wrapped prose line
MAX_PAGE_LINES, MAX_INDEX_LINES, MAX_PROSE_CHARS = 500, 400, 400  # the book's limits (tests/test_results_book.py)
CLAIMS = "claims_detail"  # the section analysis/claims.py writes (analysis.common.DETAIL)
# page -> (its title, the sections it holds in experiments/reproduce.py's order)
PAGES = {
    "claims": ("The claims in detail", [CLAIMS]),
    "dsa": ("Disk Sparse Adam", ["correctness", "dsa_throughput", "dsa_seed_benchmark", "dsa_billions",
                                 "dsa_out_of_core", "dsa_fault_injection", "dsa_distributed", "poincare"]),
    "gefen_memory": ("Gefen: state, peak memory and what fits a budget", ["gefen_memory", "gefen_peak_memory",
                                                                          "gefen_budgets"]),
    "gefen_quality": ("Gefen: loss against AdamW's", ["convergence", "convergence_bf16"]),
    "gefen_models": ("Gefen on models it was not tuned on, and longer", ["convergence_encoder", "convergence_llama",
                                                                         "convergence_long", "convergence_long_lr"]),
    "ablations": ("Gefen ablations", ["gefen_ablation"]),
    "theory": ("Gefen's blocks and codebook", ["hessian_alignment", "codebook"]),
    "gefen_speed": ("Gefen: step time and throughput", ["gefen_speed", "gefen_distributed"]),
    "gpu": ("Triton kernels on the GPU", ["kernel_resources"]),
}
PAGE_OF = {section: page for page, (_, sections) in PAGES.items() for section in sections}


def page_of(section: str) -> str:
    """The page that holds ``section``; a section no page lists is refused with the list to add it to."""
    if section not in PAGE_OF:
        raise KeyError(f"results book: section {section!r} is on no page; add it to analysis/book.py's PAGES")
    return PAGE_OF[section]


def page_file(section: str, results_dir) -> Path:
    """Where ``section`` goes: its page of the committed book, else ``README.md`` beside the results."""
    from analysis.common import is_committed

    if is_committed(results_dir):
        return Path(results_dir) / f"{page_of(section)}.md"
    return Path(results_dir) / "README.md"


def is_page(path) -> bool:
    """Whether ``path`` is a page of the book (not its index, not another folder's README)."""
    return Path(path).stem in PAGES and Path(path).suffix == ".md"


def head(page: str) -> str:
    """A page's first lines: its title and the way back to the index."""
    return (f"# {PAGES[page][0]}\n\nA page of the results book ([index](README.md)): every section is generated "
            "from the committed CSVs; its setup line names the run.\n")


def link(section: str, title: str) -> str:
    """A Markdown link to ``section``'s heading ``title`` from any page of the book or its index."""
    from analysis.common import anchor

    return f"[{title}]({page_of(section)}.md#{anchor(title)})"


_KEEP = re.compile(r"^(\||#|!\[|<!--|```|    |\s*$)")  # table rows, headings, images, markers, code: as they are


def wrapped(text: str, width: int = WIDTH) -> str:
    """``text`` with every prose line longer than ``width`` wrapped (a list item's continuation
    indented under it); tables, headings, images, markers and code stay as they are."""
    out, fence = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
        if fence or len(line) <= width or _KEEP.match(line):
            out.append(line)
            continue
        item = re.match(r"^(\s*(?:[-*]|\d+\.)\s+)", line)
        indent = " " * len(item.group(1)) if item else ""
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def index(claims_table: str) -> str:
    """The body of results/README.md below its head: the claims' short table and the pages."""
    pages = "\n".join(f"- [{title}]({page}.md): " + ", ".join(f"`{s}`" for s in sections)
                      for page, (title, sections) in PAGES.items())
    return "\n\n".join(["## Claims", claims_table, "## Pages",
                        "Each page holds the sections of the analysis scripts named after it "
                        "(`python analysis/NAME.py` writes section NAME):", pages])
