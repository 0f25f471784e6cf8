"""Gefen's named layouts (``optim/gefen/layout.py``): one keyword, ``layout=``, chooses the state.

* each named layout, at 8 and 4 bits, on torch, numba and Triton (interpreted), steps bit for bit as
  an optimizer whose group spells out its options (``NOW``: the keywords the old registry passed before
  layouts were records, ``SWITCHES``, but for the 8-bit compact layout's column factor);
* a state dict saved at commits b35d848 and a61f9ed by each registry name
  (``tests/data/gefen_<commit>_state_dicts.pt``, made by this file's ``__main__`` copied into a checkout
  of that commit: ``git archive <commit> | tar -x -C /tmp/old; cp tests/test_gefen_layouts.py
  /tmp/old/tests/; cd /tmp/old; PYTHONPATH=. python tests/test_gefen_layouts.py <out>``) loads into the
  registry name now and continues bit for bit; one
  saved before the layout options existed loads as the published layout;
* ``layout_of`` refuses an unknown name, a record an invalid field, by name and value;
* the constructor has at most five keywords beyond ``torch.optim.AdamW``'s.
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

from experiments.harness.registry import make_optimizer

SAVED = {commit: Path(__file__).parent / "data" / f"gefen_{commit}_state_dicts.pt" for commit in ("b35d848", "a61f9ed")}
SHAPES = [(24, 16), (16,), (40, 8), (7,)]
NAMES = ("Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored", "Gefen-8bit-compact",
         "Gefen-4bit-compact")
_COMPACT = dict(share_vector_second_moment=True, share_matrix_rows=True, row_group_scales=True,
                whole_matrix_factor=True)
SWITCHES = {  # (name, bits): the keywords that chose the layout before it was a record
    ("published", 8): {}, ("published", 4): {},
    ("factored", 8): dict(factor_second_moment=True), ("factored", 4): dict(factor_second_moment=True),
    ("compact", 8): dict(factor_second_moment=True, **_COMPACT),
    ("compact", 4): dict(factor_second_moment=True, **dict(_COMPACT, row_group_scales=512)),
    ("adamw", 8): dict(share_second_moment=False, quantize_first_moment=False),
    ("adamw", 4): dict(share_second_moment=False, quantize_first_moment=False),
}
# (name, bits): the options each name stands for now, spelled out (the 8-bit compact layout's column
# factor is a bf16 one per tile since the candidates ablation, no longer an fp32 one per matrix; the
# factored and compact layouts bound the first moment since it was found unbounded)
NOW = {**SWITCHES, ("compact", 8): dict(factor_second_moment=True, share_vector_second_moment=True,
                                        share_matrix_rows=True, row_group_scales=True, factor_dtype="bfloat16")}
NOW = {key: dict(options, bound_first_moment=True) if key[0] in ("factored", "compact") else options
       for key, options in NOW.items()}
REGISTRY = {"Gefen-8bit": ("published", 8), "Gefen-4bit": ("published", 4), "Gefen-8bit-factored": ("factored", 8),
            "Gefen-4bit-factored": ("factored", 4), "Gefen-8bit-compact": ("compact", 8),
            "Gefen-4bit-compact": ("compact", 4)}


def _problem():
    """Initial weights and five steps of gradients (row-scaled for matrices), the same at every commit."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) * (torch.exp(torch.randn(s[0], 1, generator=gen)) if len(s) == 2 else 1)
              for s in SHAPES] for _ in range(5)]
    return init, grads


def _steps(opt, ps, grads):
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()


def _run_registry(name, stop=None, **options):
    """``name`` from the registry (torch step, ``options`` its keywords) over ``_problem``: its state dict
    after two steps and the weights and state dict after five (the first two only, with ``stop=2``)."""
    init, grads = _problem()
    ps = [torch.nn.Parameter(x.clone()) for x in init]
    opt = make_optimizer(name, ps, 1e-2, 0.1, backend="torch", **options)
    _steps(opt, ps, grads[:2])
    rec = {"saved": copy.deepcopy(opt.state_dict())}  # its tensors are the state the next steps update
    if stop != 2:
        _steps(opt, ps, grads[2:])
        rec.update(final=[p.detach().clone() for p in ps], final_state=opt.state_dict())
    return rec


def _same_state(a: dict, b: dict):
    """``a``'s state dict equals ``b``'s (its groups on the keys ``b``'s have: an older one lacks the later options)."""
    assert [{k: g[k] for k in h} for g, h in zip(a["param_groups"], b["param_groups"])] == b["param_groups"]
    assert set(a["state"]) == set(b["state"])
    for k, st in a["state"].items():
        assert set(st) == set(b["state"][k]), k
        for key, v in st.items():
            w = b["state"][k][key]
            assert (torch.equal(v, w) if torch.is_tensor(v) else v == w), (k, key)
    assert (a["codebook"] is None and b["codebook"] is None) or torch.equal(a["codebook"], b["codebook"])


@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
@pytest.mark.parametrize("name,bits", list(NOW))
def test_each_named_layout_steps_as_its_options_spelled_out_in_the_group(name, bits, backend):
    from optim import Gefen
    from optim.backends import numba_available

    if backend == "numba" and not numba_available():
        pytest.skip("numba is not installed")
    init, grads = _problem()
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    hyper = dict(lr=1e-2, weight_decay=0.1, bits=bits, backend=backend)
    opt = Gefen(ours, layout=name, **hyper)
    ref = Gefen([{"params": theirs, **NOW[name, bits]}], layout="published", **hyper)
    assert opt.param_groups[0] == {**ref.param_groups[0], "params": ours}
    steps = 3 if backend == "triton" else 5
    _steps(opt, ours, grads[:steps])
    _steps(ref, theirs, grads[:steps])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    sa, sb = opt.state_dict(), ref.state_dict()
    _same_state(sa, sb)


def test_the_default_layout_is_the_factored_one_and_the_registry_names_are_the_layouts():
    from optim import Gefen
    from optim.gefen import layout_of

    ps = [torch.nn.Parameter(torch.randn(4, 4))]
    assert Gefen(ps).param_groups[0]["factor_second_moment"] is True
    assert {k: Gefen(ps).param_groups[0][k] for k in layout_of("factored").fields()} == layout_of("factored").fields()
    for reg, (name, bits) in REGISTRY.items():
        group = make_optimizer(reg, ps, 1e-3).param_groups[0]
        assert {k: group[k] for k in layout_of(name, bits).fields()} == layout_of(name, bits).fields(), reg
        assert group["bits"] == bits


@pytest.mark.parametrize("commit,name", [(c, n) for c in SAVED for n in NAMES if c == "a61f9ed" or "compact" not in n])
def test_a_state_dict_saved_before_layouts_continues_bit_for_bit(commit, name):
    """The registry name's state dict saved by the code of ``commit`` (switches as keywords; the compact
    names came after b35d848) loads into the same name now (a layout, which may stand for another record
    since: the saved groups' options are the ones that continue) and the last three steps give that
    run's weights and state."""
    from optim.gefen.layout import GefenLayout

    then = GefenLayout(**SWITCHES[REGISTRY[name]])  # the record the name stood for at ``commit``
    old = torch.load(SAVED[commit], weights_only=True)[name]
    now = _run_registry(name, layout=then)
    _same_state(now["saved"], old["saved"])  # the same run saves the same dict
    init, grads = _problem()
    ps = [torch.nn.Parameter(x.clone()) for x in init]
    opt = make_optimizer(name, ps, 1e-2, 0.1, backend="torch", layout=then)
    _steps(opt, ps, grads[:2])  # the weights at the checkpoint
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    resumed = make_optimizer(name, fresh, 1e-2, 0.1, backend="torch")
    resumed.load_state_dict(old["saved"])
    _steps(resumed, fresh, grads[2:])
    assert all(torch.equal(a, b) for a, b in zip(fresh, old["final"]))
    _same_state(resumed.state_dict(), old["final_state"])


def test_a_state_dict_saved_before_the_layout_options_loads_as_the_published_layout():
    """A group saved before the factor and its options existed (none of their keys) means the published
    layout: it loads into Gefen-8bit and continues as the full dict does."""
    from optim.gefen.layout import GefenLayout

    old = torch.load(SAVED["a61f9ed"], weights_only=True)["Gefen-8bit"]
    later = set(GefenLayout().fields()) - {"share_second_moment", "quantize_first_moment", "block_rule"}
    bare = dict(old["saved"], param_groups=[{k: v for k, v in g.items() if k not in later | {"maximize"}}
                                            for g in old["saved"]["param_groups"]])
    init, grads = _problem()
    ends = []
    for sd in (old["saved"], bare):
        ps = [torch.nn.Parameter(x.clone()) for x in init]
        opt = make_optimizer("Gefen-8bit", ps, 1e-2, 0.1, backend="torch")
        _steps(opt, ps, grads[:2])
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["factor_second_moment"] is False
        _steps(opt, ps, grads[2:])
        ends.append(ps)
    assert all(torch.equal(a, b) for a, b in zip(*ends))
    assert all(torch.equal(a, b) for a, b in zip(ends[1], old["final"]))


def test_a_group_may_give_its_own_layout():
    from optim import Gefen
    from optim.gefen import layout_of

    a, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))
    opt = Gefen([{"params": [a]}, {"params": [b], "layout": "adamw"}], layout="compact")
    assert "layout" not in opt.param_groups[1]
    assert {k: opt.param_groups[1][k] for k in layout_of("adamw").fields()} == layout_of("adamw").fields()
    assert opt.param_groups[0]["share_matrix_rows"] is True
    with pytest.raises(ValueError, match="codebook_refresh_every"):  # one per optimizer, as before
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))],
                             "layout": layout_of("compact").replace(codebook_refresh_every=5)})


def test_layout_of_refuses_an_unknown_name_listing_the_names():
    from optim.gefen import layout_of

    with pytest.raises(ValueError, match="unknown layout 'compressed'.*published.*factored.*compact.*adamw"):
        layout_of("compressed", 8)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        layout_of("compact", 3)
    record = layout_of("factored")
    assert layout_of(record, 4) is record


@pytest.mark.parametrize("field,value", [("share_second_moment", "no"), ("row_group_scales", 0),
                                         ("row_group_scales", 1.5), ("factor_dtype", "float16"),
                                         ("first_moment_rounding", "random"), ("codebook_refresh_every", -1),
                                         ("block_rule", "names"), ("whole_matrix_factor", 2)])
def test_a_record_with_an_invalid_field_is_refused_by_name(field, value):
    from optim.gefen import GefenLayout, layout_of

    with pytest.raises(ValueError, match=f"{field}.*{re.escape(repr(value))}"):
        GefenLayout(**{field: value})
    with pytest.raises(ValueError, match=field):
        layout_of("factored").replace(**{field: value})
    with pytest.raises(ValueError, match="no field 'factored'"):
        layout_of("factored").replace(factored=True)


def test_the_constructor_has_at_most_five_keywords_beyond_adamws():
    from optim import Gefen

    ours = set(inspect.signature(Gefen).parameters)
    adamw = set(inspect.signature(torch.optim.AdamW).parameters)
    assert len(ours - adamw) <= 5, sorted(ours - adamw)
    assert adamw <= ours
    assert inspect.signature(Gefen).parameters["layout"].default == "factored"


if __name__ == "__main__":  # copied into a checkout of an older commit (module docstring): write its SAVED file
    from experiments.harness.registry import OPTIMIZERS

    torch.save({name: _run_registry(name) for name in NAMES if name in OPTIMIZERS}, sys.argv[1])
