"""The results book (analysis/book.py): results/README.md indexes every page, each page within its
limits and up to date, and one analysis summarises every committed ablation CSV row for row.

Table rows are exempt from the prose width: a Markdown table row cannot wrap, and the index's claims
table quotes each verdict whole."""

import re
import shutil
import statistics

import pytest

from analysis import book, common
from analysis import gefen_ablation as ablations
from experiments.harness.common import RESULTS_DIR, read_results
from experiments.gefen_ablation import ABLATIONS, COMPACT_VARIANT, variant_layout
from optim.gefen.layout import layout_of

PAGES = sorted(RESULTS_DIR.glob("*.md"))


def test_the_index_links_every_page_and_every_page_is_in_the_book():
    index = (RESULTS_DIR / "README.md").read_text()
    linked = set(re.findall(r"\]\(([a-z_0-9]+)\.md\)", index))
    assert linked == set(book.PAGES), linked ^ set(book.PAGES)
    assert {p.stem for p in PAGES} - {"README"} == set(book.PAGES)


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_the_book_keeps_its_limits(path):
    lines = path.read_text().splitlines()
    limit = book.MAX_INDEX_LINES if path.name == "README.md" else book.MAX_PAGE_LINES
    assert len(lines) <= limit, f"{path.name}: {len(lines)} lines, more than {limit}"
    long = [(k + 1, len(line)) for k, line in enumerate(lines)
            if len(line) > book.MAX_PROSE_CHARS and not line.startswith("|")]
    assert not long, f"{path.name}: prose lines (line, characters) over {book.MAX_PROSE_CHARS}: {long}"


def test_every_link_into_the_book_names_a_heading_of_its_page():
    anchors = {p.stem: {common.anchor(line[3:].strip()) for line in p.read_text().splitlines() if line.startswith("## ")}
               for p in PAGES}
    for path in PAGES:
        for page, anchor in re.findall(r"\]\(([a-z_0-9]+)\.md#([^)]+)\)", path.read_text()):
            assert anchor in anchors[page], (path.name, page, anchor)


def test_wrapped_keeps_tables_and_wraps_prose_and_list_items():
    words = " ".join(f"word{k}" for k in range(60))
    text = "\n".join(["| a | " + "x" * 300 + " |", words, f"- {words}", "![fig](" + "p" * 200 + ".png)"])
    out = book.wrapped(text, width=50).splitlines()
    assert out[0] == "| a | " + "x" * 300 + " |" and out[-1].startswith("![fig](")
    prose = out[1:-1]
    assert all(len(line) <= 50 for line in prose)
    assert " ".join(line.strip().removeprefix("- ") for line in prose) == f"{words} {words}"
    item = prose.index(next(line for line in prose if line.startswith("- ")))
    assert all(line.startswith("  ") for line in prose[item + 1:])


def test_a_section_on_no_page_is_refused_with_where_to_add_it():
    with pytest.raises(KeyError, match="analysis/book.py's PAGES"):
        book.page_of("no_such_section")


def test_the_ablations_page_is_up_to_date_with_every_ablation_csv(tmp_path):
    """The ablation analysis run on copies of the committed CSVs writes, once wrapped, the section of
    results/ablations.md (the figure's link aside: it points beside the copies)."""
    for path in [*RESULTS_DIR.glob("gefen_ablation*"), *RESULTS_DIR.glob("gefen_memory.*")]:
        shutil.copy(path, tmp_path / path.name)
    common.main(ablations.REPORT, ["--results-dir", str(tmp_path), "--out", str(tmp_path / "fig.png")])
    fresh = book.wrapped(common.read_section(tmp_path / "README.md", "gefen_ablation"))
    committed = common.read_section(RESULTS_DIR / "ablations.md", "gefen_ablation")
    drop = re.compile(r"^!\[gefen_ablation\]\(.*\)$", re.M)
    assert drop.sub("", fresh) == drop.sub("", committed)


def test_the_summary_has_every_committed_ablation_row():
    """One row a (ablation, configuration, variant) of every committed ablation CSV, its median the
    median of the CSV's ratios over seeds."""
    rows = read_results(RESULTS_DIR / "gefen_ablation.csv")
    committed = [n for n in ABLATIONS if (RESULTS_DIR / f"{n}.csv").exists()]  # the table's ablations with a committed CSV
    config = {"config": common.load_config("gefen_ablation", RESULTS_DIR)["config"],
              "other_rows": {n: read_results(RESULTS_DIR / f"{n}.csv") for n in [*committed, "gefen_memory"]}}
    table = {(n, v, label): med for n, v, label, _, _, med, _, _ in ablations.summary(rows, config)}
    assert {n for n, _, _ in table} == set(committed)
    for name in committed:
        csv_rows = read_results(RESULTS_DIR / f"{name}.csv")
        ratios = {}
        for r in csv_rows:
            if r["metric"] == "val_loss_vs_adamw" and not r["variant"].endswith("AdamW"):
                ratios.setdefault(r["variant"], []).append(r["value"])
        assert len([k for k in table if k[0] == name]) == len(ratios), name
        for variant, values in ratios.items():
            short = variant.rpartition("/")[2]
            match = [med for (n, v, label), med in table.items() if n == name and v == short
                     and (label == variant.rpartition("/")[0] or "/" not in variant)]
            assert statistics.median(values) in match, (name, variant)


def test_named_variants_are_the_named_layouts():
    # the ablations' runs measured the factored and compact layouts without the first-moment bound; the
    # variants that add it are the named layouts of today
    unbounded = {name: {bits: layout_of(name, bits).replace(bound_first_moment=False) for bits in (8, 4)}
                 for name in ("factored", "compact")}
    assert variant_layout("none", 8) == layout_of("published", 8)
    assert variant_layout("factored", 4) == unbounded["factored"][4]
    assert variant_layout("factored+bound", 8) == layout_of("factored", 8)
    assert variant_layout("factored+layout_w16", 8) == unbounded["compact"][8]
    assert variant_layout("factored+layout_w16_bound", 8) == layout_of("compact", 8)
    assert variant_layout("factored+layout512", 4) == unbounded["compact"][4]
    assert variant_layout("factored+layout512_bound", 4) == layout_of("compact", 4)
    assert all(variant_layout(v, bits) == unbounded["compact"][bits] for bits, v in COMPACT_VARIANT.items())
    # the compact layout as first measured: one fp32 column factor per matrix, at 8 bits as at 4
    assert variant_layout("factored+layout", 8) == unbounded["compact"][8].replace(
        whole_matrix_factor=True, factor_dtype="float32")
    assert ablations.registry_name("factored+layout_w16", 8) == "Gefen-8bit-compact"
    assert ablations.registry_name("factored+layout", 8) is None
    assert ablations.registry_name("factored+layout512", 4) == "Gefen-4bit-compact"
    assert ablations.registry_name("factored+attn_qkv", 8) is None
