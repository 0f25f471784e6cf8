"""experiments/convergence.py (tiny size, in-process) and analysis/convergence.py (fixture CSV)."""

import argparse
import math
import statistics

import pytest
import torch

from analysis import convergence as conv_fig
from experiments import _charlm as charlm
from experiments import convergence as conv
from experiments.common import Results, add_common_args, read_results

TINY = ["--tiny", "--wandb", "disabled", "--no-progress"]


# ------------------------------------------------------------------ data and model
def test_corpus_is_capped_and_starts_with_the_documentation():
    from pydoc_data.topics import topics

    text = charlm.load_text(50_000)
    assert len(text) == 50_000
    first = topics[sorted(topics)[0]]
    assert text.startswith(first[:1000])
    assert charlm.load_text(50_000) == text  # deterministic
    big = charlm.load_text(600_000)  # past the topics (~0.46 M chars): standard-library code follows
    doc_chars = sum(len(v) for v in topics.values())
    assert doc_chars < 600_000
    stdlib_first = charlm.stdlib_sources()[0].read_text(encoding="utf-8", errors="replace")
    assert big[doc_chars:doc_chars + 200] == stdlib_first[:200]


def test_encode_decode_and_split_are_consistent():
    text = "def f(x):\n\treturn x + 1  # é\n"
    ids = charlm.encode(text)
    assert ids.dtype == torch.int64 and ids.max() < charlm.VOCAB_SIZE
    assert charlm.decode(ids) == text.replace("é", "\ufffd")
    ids = torch.randint(0, charlm.VOCAB_SIZE, (10 * 37 + 5,))
    train, val = charlm.split(ids, chunk_chars=37, val_every=5)
    # brute force: chunk i is validation iff i % 5 == 4
    expect_val = torch.cat([ids[i * 37:(i + 1) * 37] for i in range(11) if i % 5 == 4])
    expect_train = torch.cat([ids[i * 37:(i + 1) * 37] for i in range(11) if i % 5 != 4])
    assert torch.equal(val, expect_val) and torch.equal(train, expect_train)
    with pytest.raises(ValueError, match="max_chars"):
        charlm.split(ids[:50], chunk_chars=37, val_every=5)


def test_untrained_model_predicts_near_uniform():
    torch.manual_seed(0)
    cfg = charlm.GPTConfig(block=16, n_layer=1, n_head=2, n_embd=16)
    x = torch.randint(0, charlm.VOCAB_SIZE, (4, 16))
    loss = charlm.evaluate(charlm.GPT(cfg), x, x)
    assert abs(loss - math.log(charlm.VOCAB_SIZE)) < 0.1  # init std 0.02: logits near zero
    with pytest.raises(ValueError, match="block size"):
        charlm.GPT(cfg)(torch.zeros(1, 17, dtype=torch.long))


# ------------------------------------------------------------------ state bytes
def test_state_bytes_of_adamw_is_two_fp32_moments_plus_steps():
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    params = list(model.parameters())
    expected = sum(2 * 4 * p.numel() for p in params) + sum(
        opt.state[p]["step"].element_size() for p in params)
    assert conv.state_bytes(opt) == expected


def test_tensor_bytes_counts_quantised_subclasses_by_their_parts():
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    s8 = OptimState8bit.zeros((64, 128), signed=True, block_size=256)
    s4 = OptimState4bit.zeros((64, 128), signed=False, block_size=128)
    n = 64 * 128
    # 8-bit: one byte a code, one fp32 scale per 256, a 256-entry fp32 code map;
    # 4-bit: two codes a byte, one fp32 scale per 128, a 16-entry fp32 code map
    assert conv.tensor_bytes({"m": s8}) == n + 4 * n // 256 + 4 * 256
    assert conv.tensor_bytes([s4]) == n // 2 + 4 * n // 128 + 4 * 16
    shared = torch.zeros(10)
    assert conv.tensor_bytes({"a": shared, "b": shared, "c": 3, "d": "x"}) == 40


# ------------------------------------------------------------------ the experiment entry
def test_tiny_entry_writes_wellformed_rows(tmp_path):
    summary, skipped = conv.main(TINY + ["--results-dir", str(tmp_path), "--optimizers", "AdamW", "Adam-mini"])
    assert not skipped and [s[0] for s in summary] == ["AdamW", "Adam-mini"]
    rows = read_results("convergence", tmp_path)
    size = conv.SIZES["tiny"]
    cfg = charlm.GPTConfig(block=size["block"], n_layer=size["n_layer"], n_head=size["n_head"], n_embd=size["n_embd"])
    params = list(charlm.GPT(cfg).parameters())
    n_params = sum(p.numel() for p in params)
    for name in ("AdamW", "Adam-mini"):
        v = f"{name}/lr={size['lrs'][0]:g}"
        mine = [r for r in rows if r["variant"] == v]
        curve = sorted((r["x_value"], r["value"]) for r in mine if r["metric"] == "val_loss")
        assert [x for x, _ in curve] == [0, 3, 6]
        assert abs(curve[0][1] - math.log(charlm.VOCAB_SIZE)) < 0.2
        assert curve[-1][1] < curve[0][1]  # six steps already lower the validation loss
        final = [r for r in mine if r["metric"] == "final_val_loss"]
        assert len(final) == 1 and final[0]["value"] == curve[-1][1]
        metric = {r["metric"]: r["value"] for r in mine}
        assert metric["params"] == n_params
        assert final[0]["x_value"] == metric["state_bytes"]
        best = [r for r in rows if r["variant"] == name and r["metric"] == "best_lr"]
        assert [r["value"] for r in best] == [size["lrs"][0]]
    bytes_of = {r["variant"].split("/")[0]: r["value"] for r in rows if r["metric"] == "state_bytes"}
    # AdamW: exp_avg and exp_avg_sq in fp32 and one fp32 step tensor per parameter tensor
    assert bytes_of["AdamW"] == 8 * n_params + 4 * len(params)
    assert bytes_of["Adam-mini"] < 0.6 * bytes_of["AdamW"]  # one shared v per head/neuron
    assert all(r["seed"] == "0" for r in rows)


def test_peers_that_fail_are_skipped_without_rows(tmp_path, monkeypatch, capsys):
    def broken_ctor(model, lr, wd, cfg):
        raise ImportError("no such package")

    class Exploding(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("kernel missing")

    monkeypatch.setitem(conv.REGISTRY, "Broken", broken_ctor)
    monkeypatch.setitem(conv.REGISTRY, "Exploding", lambda model, lr, wd, cfg: Exploding(model.parameters(), lr=lr))
    summary, skipped = conv.main(TINY + ["--results-dir", str(tmp_path), "--optimizers", "Broken", "Exploding", "AdamW"])
    assert set(skipped) == {"Broken", "Exploding"}
    assert "no such package" in skipped["Broken"] and "kernel missing" in skipped["Exploding"]
    out = capsys.readouterr().out
    assert "skipping Broken" in out and "skipping Exploding" in out
    variants = {r["variant"].split("/")[0] for r in read_results("convergence", tmp_path)}
    assert variants == {"AdamW"}


def test_unknown_optimizer_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        conv.parse_args(["--optimizers", "Adamm"])
    assert "unknown ['Adamm']" in capsys.readouterr().err


# ------------------------------------------------------------------ the figure
def _fixture_csv(tmp_path):
    """Two optimizers, two lrs; the chosen lr has three seeds. Returns the expected finals."""
    args = add_common_args(argparse.ArgumentParser()).parse_args(
        ["--wandb", "disabled", "--results-dir", str(tmp_path)])
    finals = {("A", 0.01): [2.5, 2.7, 2.6], ("A", 0.03): [2.9], ("B", 0.01): [2.2], ("B", 0.03): [2.05, 2.15, 2.1]}
    bpp = {"A": 8.0, "B": 1.1}
    with Results("convergence", args) as res:
        for (name, lr), vals in finals.items():
            for seed, final in enumerate(vals):
                v = f"{name}/lr={lr:g}"
                for step, val in [(0, 4.6), (10, 3.0), (20, final)]:
                    res.add(v, "val_loss", "nats/char", val, x_name="step", x_value=step, seed=seed)
                res.add(v, "final_val_loss", "nats/char", final, x_name="state_bytes", x_value=bpp[name] * 100, seed=seed)
                res.add(v, "state_bytes_per_param", "B/param", bpp[name], seed=seed)
                res.add(v, "step_time", "ms", 1.0, seed=seed)
        res.add("A", "best_lr", "lr", 0.01)
        res.add("B", "best_lr", "lr", 0.03)
    return finals


def test_analysis_draws_from_a_fixture_csv(tmp_path):
    finals = _fixture_csv(tmp_path)
    out = tmp_path / "fig" / "convergence.png"
    summary = conv_fig.main(["--results-dir", str(tmp_path), "--out", str(out)])
    assert out.exists() and out.stat().st_size > 10_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["A"]["lr"] == 0.01 and summary["B"]["lr"] == 0.03
    assert statistics.fmean(summary["A"]["finals"]) == pytest.approx(statistics.fmean(finals[("A", 0.01)]))
    assert sorted(summary["B"]["finals"]) == sorted(finals[("B", 0.03)])
    assert summary["B"]["bpp"] == 1.1 and len(summary["B"]["curves"]) == 3


def test_analysis_without_best_lr_rows_prefers_the_lr_with_most_seeds(tmp_path):
    _fixture_csv(tmp_path)
    rows = [r for r in read_results("convergence", tmp_path) if r["metric"] != "best_lr"]
    summary = conv_fig.summarise(rows)
    assert summary["A"]["lr"] == 0.01 and summary["B"]["lr"] == 0.03


def test_analysis_names_a_missing_csv(tmp_path):
    with pytest.raises(FileNotFoundError, match="convergence.csv"):
        conv_fig.main(["--results-dir", str(tmp_path), "--out", str(tmp_path / "x.png")])


def test_variant_names_round_trip():
    assert conv_fig.split_variant("torchao-AdamW8bit/lr=0.003") == ("torchao-AdamW8bit", 0.003)
    assert conv_fig.split_variant("Gefen-8bit") == ("Gefen-8bit", None)


# ------------------------------------------------------------------ analysis/gefen_memory.py (its figure)
def _gefen_memory_csv(tmp_path):
    import csv

    from experiments.common import FIELDS

    rows = []

    def add(ts, variant, metric, value, x_name="model", x_value="transformer"):
        rows.append(dict(experiment="gefen_memory", variant=variant, metric=metric, unit="", x_name=x_name,
                         x_value=x_value, value=value, seed=0, device="cpu", torch_version="t",
                         git_commit="c", timestamp=ts))

    old, new = "2026-01-01T00:00:00+00:00", "2026-01-02T00:00:00+00:00"
    add(old, "Gefen 8-bit (ours)", "state_bytes_per_param", 9.99)  # an older run: must be ignored
    expected = {}
    for model, scale in (("transformer", 1.0), ("mlp", 2.0)):
        for variant, bpp, ms in (("AdamW(fused)", 8.0, 2.0), ("Gefen 8-bit (ours)", 1.04, 6.0),
                                 ("Gefen 4-bit (ours)", 0.53, 5.0)):
            add(new, variant, "state_bytes_per_param", bpp, x_value=model)
            add(new, variant, "step_time_median", scale * ms / 1e3, x_value=model)
            add(new, variant, "step_time_vs_adamw_fused", ms / 2.0, x_value=model)
            expected[(model, variant)] = (bpp, scale * ms)
    for variant, r in (("AdamW(fused)", 1.0), ("Gefen 8-bit (ours)", 1.012), ("Gefen 4-bit (ours)", 1.02)):
        add(new, variant, "val_loss_vs_adamw", r, x_name="steps", x_value=200)
    with open(tmp_path / "gefen_memory.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    return expected


def test_gefen_memory_figure_from_a_fixture_csv(tmp_path, capsys):
    from analysis import gefen_memory as mem_fig
    from analysis.common import latest_run

    expected = _gefen_memory_csv(tmp_path)
    out = tmp_path / "gefen_memory.png"
    mem_fig.main(["--results-dir", str(tmp_path), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    rows = latest_run(read_results("gefen_memory", tmp_path))
    bpp = mem_fig.table(rows, "state_bytes_per_param")
    ms = mem_fig.table(rows, "step_time_median")
    for (model, variant), (b, t) in expected.items():
        assert bpp[model][variant] == b
        assert ms[model][variant] * 1e3 == pytest.approx(t)
    printed = capsys.readouterr().out
    assert "9.99" not in printed and "1.040" in printed


@pytest.mark.parametrize("log", [False, True], ids=["linear", "log"])
def test_gefen_memory_bars_keep_every_value_in_view(log):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis import gefen_memory as mem_fig

    data = {"transformer": {"a": 0.54, "b": 8.0}, "mlp": {"a": 1070.0, "b": 21.2}}
    fig, ax = plt.subplots()
    mem_fig._bars(ax, data, ["a", "b"], log=log)
    lo, hi = ax.get_ylim()
    plt.close(fig)
    assert lo <= (0.54 if log else 0.0) and hi > 1070.0
