"""experiments/convergence.py at a tiny size (in-process), its data, model and state bytes, and
analysis/convergence.py drawing from the tiny run."""

import math
import statistics

import pytest
import torch

from experiments import convergence as conv
from experiments.harness import data as charlm
from experiments.harness import models, registry
from experiments.harness.common import read_results
from experiments.harness.train import CHAR_LM, model_label_of

TINY = ["--tiny", "--wandb", "disabled", "--no-progress", "--protocol", "best"]  # one protocol: its rows alone


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


def test_docstring_corpus_is_prose_from_package_sources_and_shares_nothing_with_the_default():
    import ast

    text = charlm.load_text(300_000, "docstrings")
    assert len(text) == 300_000 and charlm.load_text(300_000, "docstrings") == text
    files = charlm.package_sources()
    assert files and all(f.parent.name not in ("test", "tests", "idlelib") for f in files)
    # brute force on the first package file that has a module docstring: it opens the corpus in order
    first = next(f for f in files if ast.get_docstring(ast.parse(f.read_text(encoding="utf-8", errors="replace"))))
    assert text.startswith(ast.get_docstring(ast.parse(first.read_text(encoding="utf-8", errors="replace"))))
    assert "\ndef " not in text and "\nimport " not in text  # no code lines
    default = charlm.load_text(1_000_000)
    probe = text[100_000:100_200]  # a stretch from the middle is nowhere in the default corpus
    assert probe not in default
    with pytest.raises(ValueError, match="unknown corpus"):
        charlm.load_text(100, "wikipedia")


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
    cfg = models.GPTConfig(block=16, n_layer=1, n_head=2, n_embd=16)
    x = torch.randint(0, charlm.VOCAB_SIZE, (4, 16))
    loss = models.evaluate(models.GPT(cfg), x, x)
    assert abs(loss - math.log(charlm.VOCAB_SIZE)) < 0.1  # init std 0.02: logits near zero
    with pytest.raises(ValueError, match="block size"):
        models.GPT(cfg)(torch.zeros(1, 17, dtype=torch.long))


# ------------------------------------------------------------------ state bytes
def test_state_bytes_of_adamw_is_two_fp32_moments_plus_steps():
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    params = list(model.parameters())
    expected = sum(2 * 4 * p.numel() for p in params) + sum(
        opt.state[p]["step"].element_size() for p in params)
    assert registry.state_bytes(opt) == expected


@pytest.mark.parametrize("bits", [8, 4])
def test_the_compact_gefen_is_the_factored_one_with_the_layout_options_and_fewer_bytes(bits):
    """Gefen-<bits>-compact is Gefen-<bits>-factored with the compact layout's options in its group (at
    8 bits a bf16 column factor per tile, at 4 bits row-group scales of at most 512 elements and one fp32
    factor a matrix) (a layout given still wins), and after one step on row-scaled gradients of a tall
    matrix, a bias and a gain its state is smaller than the factored one's: the scales, factor bytes and
    vectors' v it drops."""
    from optim.gefen import layout_of

    options = ("share_vector_second_moment", "share_matrix_rows", "row_group_scales")
    per = {}
    for name in (f"Gefen-{bits}bit-factored", f"Gefen-{bits}bit-compact"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((512, 64), (512,), (64,))]
        opt = registry.make_optimizer(name, params, 1e-3)
        group = opt.param_groups[0]
        compact = name.endswith("compact")
        assert group["factor_second_moment"] and all(bool(group[k]) == compact for k in options)
        assert group["row_group_scales"] == ({8: True, 4: 512}[bits] if compact else False)
        assert (group["whole_matrix_factor"], group["factor_dtype"]) == (
            {8: (False, "bfloat16"), 4: (True, "float32")}[bits] if compact else (False, "float32"))
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (torch.exp(2 * torch.randn(p.shape[0], 1, generator=gen))
                                                           if p.dim() == 2 else 1.0)
        opt.step()
        per[name] = registry.state_bytes(opt)
    assert per[f"Gefen-{bits}bit-compact"] < per[f"Gefen-{bits}bit-factored"]
    opt = registry.make_optimizer(f"Gefen-{bits}bit-compact", params, 1e-3,
                                  layout=layout_of("compact", bits).replace(row_group_scales=False))
    assert opt.param_groups[0]["row_group_scales"] is False


class _Tables(torch.nn.Module):
    """An embedding, a bare position table, a projection with a bias and a norm: every kind."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(11, 16)
        self.pos = torch.nn.Parameter(torch.randn(8, 16))
        self.proj = torch.nn.Linear(16, 24)
        self.norm = torch.nn.LayerNorm(24)

    def forward(self, x):
        return self.norm(self.proj(self.tok(x) + self.pos[: x.shape[1]]))


@pytest.mark.parametrize("name", ["AdamW", "Gefen-8bit-factored", "Gefen-4bit"])
def test_state_bytes_by_kind_adds_up_and_counts_each_parameter_under_its_kind(name):
    """Each kind's bytes equal the bytes of ``opt.state[p]`` summed over its parameters (another path
    than the state dict's indices); the kinds and the shared rest add up to ``state_bytes``; AdamW's
    are 8 bytes a parameter plus a 4-byte step per tensor."""
    torch.manual_seed(0)
    model = _Tables()
    opt = registry.make_optimizer(name, model, 1e-3, 0.1)
    model(torch.randint(0, 11, (3, 8))).pow(2).mean().backward()
    opt.step()
    kinds = registry.state_bytes_by_kind(opt, model)
    want = {"embedding": ["tok.weight", "pos"], "matrix": ["proj.weight"],
            "vector": ["proj.bias", "norm.weight", "norm.bias"]}
    named = dict(model.named_parameters())
    for kind, names in want.items():
        ps = [named[n] for n in names]
        brute = sum(t.numel() * t.element_size() for p in ps for t in opt.state[p].values() if torch.is_tensor(t))
        assert kinds[kind] == (brute, sum(p.numel() for p in ps))
        if name == "AdamW":
            assert brute == 8 * kinds[kind][1] + 4 * len(ps)
    assert kinds["shared"][1] == 0 and sum(b for b, _ in kinds.values()) == registry.state_bytes(opt)
    assert (kinds["shared"][0] > 0) == name.startswith("Gefen")  # the codebook


def test_tensor_bytes_counts_quantised_subclasses_by_their_parts():
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    s8 = OptimState8bit.zeros((64, 128), signed=True, block_size=256)
    s4 = OptimState4bit.zeros((64, 128), signed=False, block_size=128)
    n = 64 * 128
    # 8-bit: one byte a code, one fp32 scale per 256, a 256-entry fp32 code map;
    # 4-bit: two codes a byte, one fp32 scale per 128, a 16-entry fp32 code map
    assert registry.tensor_bytes({"m": s8}) == n + 4 * n // 256 + 4 * 256
    assert registry.tensor_bytes([s4]) == n // 2 + 4 * n // 128 + 4 * 16
    shared = torch.zeros(10)
    assert registry.tensor_bytes({"a": shared, "b": shared, "c": 3, "d": "x"}) == 40


# ------------------------------------------------------------------ the experiment entry
def test_tiny_entry_writes_wellformed_rows(tmp_path):
    summary, skipped = conv.main(TINY + ["--results-dir", str(tmp_path), "--optimizers", "AdamW", "Adam-mini",
                                         "--lrs", "3e-3", "1e-2", "--seeds", "2"])
    assert not skipped and [s[0] for s in summary] == ["AdamW", "Adam-mini"]
    rows = read_results("convergence", tmp_path)
    size = CHAR_LM["tiny"]
    cfg = models.GPTConfig(block=size["block"], n_layer=size["n_layer"], n_head=size["n_head"], n_embd=size["n_embd"])
    params = list(models.GPT(cfg).parameters())
    n_params = sum(p.numel() for p in params)
    assert {r["variant"] for r in rows} == {"AdamW", "Adam-mini"}  # the registry names, no lr inside
    for name in ("AdamW", "Adam-mini"):
        mine = [r for r in rows if r["variant"] == name]
        sweep = {r["x_value"]: r["value"] for r in mine if r["metric"] == "lr_sweep_val_loss"}
        assert set(sweep) == {3e-3, 1e-2}
        best = [r["value"] for r in mine if r["metric"] == "best_lr"]
        assert best == [min(sweep, key=sweep.get)]
        for seed in ("0", "1"):
            curve = sorted((r["x_value"], r["value"]) for r in mine if r["metric"] == "val_loss" and r["seed"] == seed)
            assert [x for x, _ in curve] == [0, 3, 6]
            assert abs(curve[0][1] - math.log(charlm.VOCAB_SIZE)) < 0.2
            assert curve[-1][1] < curve[0][1]  # six steps already lower the validation loss
            metric = {r["metric"]: r for r in mine if r["seed"] == seed and r["x_name"] == "lr"}
            assert metric["final_val_loss"]["value"] == curve[-1][1] and metric["final_val_loss"]["x_value"] == best[0]
            assert metric["params"]["value"] == n_params
        assert sweep[best[0]] == [r["value"] for r in mine if r["metric"] == "final_val_loss" and r["seed"] == "0"][0]
    bytes_of = {r["variant"]: r["value"] for r in rows if r["metric"] == "state_bytes" and r["seed"] == "0"}
    of_kind = {r["x_value"]: r["value"] for r in rows
               if r["metric"] == "state_bytes_per_param_of_kind" and r["variant"] == "AdamW" and r["seed"] == "0"}
    n_vec = sum(p.numel() for p in params if p.dim() == 1)
    assert of_kind["vector"] == pytest.approx(8 + 4 * sum(p.dim() == 1 for p in params) / n_vec)
    assert of_kind["shared"] == 0 and set(of_kind) == set(registry.KINDS)
    # AdamW: exp_avg and exp_avg_sq in fp32 and one fp32 step tensor per parameter tensor
    assert bytes_of["AdamW"] == 8 * n_params + 4 * len(params)
    assert bytes_of["Adam-mini"] < 0.6 * bytes_of["AdamW"]  # one shared v per head/neuron
    # the one Gefen-vs-AdamW style number: final loss / AdamW's, paired by seed
    final = {(r["variant"], r["seed"]): r["value"] for r in rows if r["metric"] == "final_val_loss"}
    ratio = {r["seed"]: r["value"] for r in rows if r["variant"] == "Adam-mini" and r["metric"] == "val_loss_vs_adamw"}
    assert ratio == pytest.approx({s: final[("Adam-mini", s)] / final[("AdamW", s)] for s in ("0", "1")}, rel=1e-12)
    mean = [r["value"] for r in rows if r["variant"] == "Adam-mini" and r["metric"] == "val_loss_vs_adamw_mean"]
    assert mean == pytest.approx([statistics.fmean(ratio.values())])
    assert {r["x_value"] for r in rows if r["metric"].startswith("val_loss_vs_adamw")} == {f"char-gpt-{n_params // 1000}k"}


def test_peers_that_fail_are_skipped_without_rows(tmp_path, monkeypatch, capsys):
    def broken_ctor(params, named, lr, weight_decay, **kw):
        raise ImportError("no such package")

    class Exploding(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("kernel missing")

    monkeypatch.setitem(registry.OPTIMIZERS, "Adam-mini", broken_ctor)
    monkeypatch.setitem(registry.OPTIMIZERS, "Gefen-4bit", lambda params, named, lr, wd, **kw: Exploding(params, lr=lr))
    summary, skipped = conv.main(TINY + ["--results-dir", str(tmp_path), "--optimizers", "Adam-mini", "Gefen-4bit",
                                         "AdamW"])
    assert set(skipped) == {"Adam-mini", "Gefen-4bit"}
    assert "no such package" in skipped["Adam-mini"] and "kernel missing" in skipped["Gefen-4bit"]
    out = capsys.readouterr().out
    assert "skipping Adam-mini" in out and "skipping Gefen-4bit" in out
    assert {r["variant"] for r in read_results("convergence", tmp_path)} == {"AdamW"}


def test_unknown_optimizer_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        conv.parse_args(["--optimizers", "Adamm"])
    assert "unknown ['Adamm']" in capsys.readouterr().err


# ------------------------------------------------------------------ the figure
def test_analysis_draws_from_a_tiny_run(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    conv.main(TINY + ["--results-dir", str(tmp_path), "--optimizers", "AdamW", "Gefen-8bit", "--seeds", "2"])
    out = tmp_path / "fig" / "convergence.png"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "analysis" / "convergence.py"), "--results-dir", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # the bytes by kind: AdamW's matrices 8 B/param and a 4-byte step per tensor, from the model itself
    from analysis.common import read_section

    section = read_section(tmp_path / "README.md", "convergence")
    row = next(line for line in section.splitlines() if line.startswith("| AdamW | 8.0"))
    size = CHAR_LM["tiny"]
    model = models.GPT(models.GPTConfig(block=size["block"], n_layer=size["n_layer"], n_head=size["n_head"],
                                        n_embd=size["n_embd"]))
    tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    mats = [p for p in model.parameters() if p.dim() == 2 and all(p is not t for t in tables)]
    for col, ps in ((3, mats), (4, tables)):
        assert row.split("|")[col].strip() == f"{8 + 4 * len(ps) / sum(p.numel() for p in ps):.4g}"


def test_extra_configuration_on_the_docstring_corpus_is_labelled_by_it_and_trained_on_it(tmp_path, monkeypatch):
    """An extra configuration with ``corpus="docstrings"`` carries the corpus in its label and its
    config, and its losses are the docstring corpus's: they differ from the same model's on the
    default corpus."""
    monkeypatch.setitem(CHAR_LM, "tiny-docstrings", dict(CHAR_LM["tiny"], corpus="docstrings"))
    conv.main(TINY + ["--optimizers", "AdamW", "--seeds", "1", "--results-dir", str(tmp_path), "--jobs", "1",
                      "--extra", "tiny", "tiny-docstrings"])
    rows = read_results("convergence", tmp_path)
    final = {r["variant"]: r["value"] for r in rows if r["metric"] == "final_val_loss"}
    label = model_label_of(sum(p.numel() for p in models.GPT(models.GPTConfig(
        block=CHAR_LM["tiny"]["block"], n_layer=1, n_head=2, n_embd=16)).parameters()))
    assert set(final) == {"AdamW", f"{label}/AdamW", f"{label}-docstrings/AdamW"}
    assert final["AdamW"] == final[f"{label}/AdamW"]  # the same size on the same corpus: the same run
    assert final[f"{label}-docstrings/AdamW"] != final["AdamW"]
    import json

    config = json.loads((tmp_path / "convergence.config.json").read_text())["config"]
    assert config["extra"][f"{label}-docstrings"]["corpus"] == "docstrings"


@pytest.mark.slow
def test_larger_configuration_rows_two_jobs_equal_one_and_figure(tmp_path):
    """The second configuration (here the tiny size again) writes ``<label>/<optimizer>`` rows and its
    own paired ratios; two runs at a time in worker processes give the very rows of one at a time
    (every run is seeded); the figure draws both configurations."""
    import subprocess
    import sys
    from pathlib import Path

    argv = TINY + ["--optimizers", "AdamW", "Gefen-8bit-factored", "--seeds", "2"]
    conv.main(argv + ["--results-dir", str(tmp_path / "one"), "--jobs", "1", "--large", "tiny"])
    conv.main(argv + ["--results-dir", str(tmp_path / "two"), "--jobs", "2", "--large", "none"])
    one, two = read_results("convergence", tmp_path / "one"), read_results("convergence", tmp_path / "two")

    def key(rows):
        return sorted((r["variant"], r["metric"], r["x_value"], r["seed"], r["value"]) for r in rows
                      if r["metric"] not in ("step_time", "wall_time") and "/" not in r["variant"]
                      and not r["metric"].startswith("val_loss_vs_adamw"))  # "one" has both configurations' ratios

    assert key(one) == key(two)
    label = model_label_of(sum(p.numel() for p in models.GPT(models.GPTConfig(
        block=CHAR_LM["tiny"]["block"], n_layer=1, n_head=2, n_embd=16)).parameters()))
    assert {r["variant"] for r in one} == {"AdamW", "Gefen-8bit-factored", f"{label}/AdamW",
                                           f"{label}/Gefen-8bit-factored"}
    ratio = [r for r in one if r["metric"] == "val_loss_vs_adamw_median" and r["variant"] == "Gefen-8bit-factored"]
    assert len(ratio) == 2  # one per configuration (both labelled alike here: the same tiny model)
    out = tmp_path / "fig.png"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "analysis" / "convergence.py"), "--results-dir",
                           str(tmp_path / "one"), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_both_protocols_share_their_common_runs(tmp_path, monkeypatch):
    """--protocol both trains each (optimizer, lr, seed) once: the drop-in AdamW is the best-lr AdamW,
    and an optimizer whose best lr is AdamW's has the same rows in both protocols."""
    calls = []
    job = conv._job
    monkeypatch.setattr(conv, "_job", lambda *a: calls.append(a[:3]) or job(*a))
    conv.main(TINY + ["--results-dir", str(tmp_path), "--optimizers", "AdamW", "Gefen-8bit-factored",
                      "--lrs", "3e-3", "1e-2", "--seeds", "2", "--protocol", "both", "--jobs", "1"])
    assert len(calls) == len(set(calls))
    rows = read_results("convergence", tmp_path)
    final = {(r["variant"], r["seed"]): r["value"] for r in rows if r["metric"] == "final_val_loss"}
    lr = {r["variant"]: r["value"] for r in rows if r["metric"] in ("best_lr", "lr")}
    assert lr["dropin/AdamW"] == lr["AdamW"] == lr["dropin/Gefen-8bit-factored"]
    for seed in ("0", "1"):
        assert final[("dropin/AdamW", seed)] == final[("AdamW", seed)]
        if lr["Gefen-8bit-factored"] == lr["AdamW"]:
            assert final[("dropin/Gefen-8bit-factored", seed)] == final[("Gefen-8bit-factored", seed)]
    # AdamW's sweep (2) and its other seed, the Gefen's sweep (2) and its other seed, and its drop-in
    # runs where its best lr is not AdamW's
    assert len(calls) == 6 + (0 if lr["Gefen-8bit-factored"] == lr["AdamW"] else 1)
