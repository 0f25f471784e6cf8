"""Each private PyTorch API ``optim`` uses (``optim/_torch_private.py``), checked on its own: a torch
upgrade that changes one fails here, naming it."""

import torch
import torch.distributed as dist

from optim import _torch_private as tp


def _sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1)


def test_state_dict_hooks_are_the_registered_ones_in_order():
    opt = _sgd()
    made = {}
    for kind in ("state_dict_pre", "state_dict_post", "load_state_dict_pre", "load_state_dict_post"):
        register = getattr(opt, f"register_{kind}_hook")
        first, second = (lambda *a: None), (lambda *a: None)
        register(first)
        register(second, prepend=True)
        made[kind] = [second, first]
    for kind, hooks in made.items():
        assert tp.state_dict_hooks(opt, kind) == hooks, kind


def test_copied_optimizer_hooks_run_on_the_copy_and_are_its_own():
    source, target = _sgd(), _sgd()
    seen = []
    source.register_state_dict_post_hook(lambda opt, sd: seen.append(opt))
    source.register_step_post_hook(lambda opt, args, kwargs: seen.append(("step", opt)))
    tp.copy_optimizer_hooks(source, target)
    target.state_dict()
    target.step()
    assert seen == [target, ("step", target)]
    target.register_state_dict_post_hook(lambda opt, sd: seen.append("target only"))
    seen.clear()
    source.state_dict()
    assert seen == [source]


def test_graph_task_id_differs_between_backwards_and_is_negative_outside():
    p = torch.randn(3, requires_grad=True)
    seen = []
    p.register_hook(lambda g: seen.append(tp.graph_task_id()))
    (p * 2).sum().backward()
    (p * 3).sum().backward()
    assert len(seen) == 2 and seen[0] >= 0 and seen[1] >= 0 and seen[0] != seen[1]
    assert tp.graph_task_id() < 0


def test_at_backward_end_runs_after_every_gradient_is_accumulated():
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    events = []

    def hook(name):
        def record(p):
            if not events:  # the first hook of this backward queues the end
                tp.at_backward_end(lambda: events.append(("end", a.grad is not None, b.grad is not None)))
            events.append(name)
        return record

    a.register_post_accumulate_grad_hook(hook("a"))
    b.register_post_accumulate_grad_hook(hook("b"))
    (a.sum() + (b * 2).sum()).backward()
    assert events in (["a", "b", ("end", True, True)], ["b", "a", ("end", True, True)]), events


def test_an_lr_scheduler_keeps_a_step_marked_as_its_wrapper():
    opt = _sgd()

    def step(*args, **kwargs):
        return None

    tp.mark_lr_scheduler_wrapped(step)
    opt.step = step
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    assert opt.step is step  # not wrapped again
    plain = _sgd()
    assert not tp.is_lr_scheduler_wrapped(plain.step)
    torch.optim.lr_scheduler.StepLR(plain, step_size=1)
    assert tp.is_lr_scheduler_wrapped(plain.step)


def test_local_shape_and_offset_of_a_row_shard(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.randn(5, 2)
        d = DTensor.from_local(full, mesh, [Shard(0)], run_check=False)
        shape, offset = tp.local_shape_and_offset(d)
        assert tuple(shape) == (5, 2) and tuple(offset) == (0, 0)
    finally:
        dist.destroy_process_group()


def test_is_dcp_init_step_recognises_torchs_state_init_step():
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(tp.is_dcp_init_step(self, lambda g: not bool(g.any())))

    seen = []
    opt = Recording([torch.nn.Parameter(torch.randn(3))], lr=0.1)
    _init_optim_state(opt)
    assert seen == [True]
    opt.param_groups[0]["params"][0].grad = torch.zeros(3)
    opt.step()  # lr 0.1: an ordinary step
    assert seen == [True, False]


def _stepped_sgd(groups=2):
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2 * groups)]
    opt = torch.optim.SGD([{"params": params[2 * k:2 * k + 2], "lr": 0.1 * (k + 1)} for k in range(groups)],
                          lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt, params


def test_packed_layout_is_torchs_state_dict():
    """``OptimizerBase`` packs torch's layout itself (to run the hooks once): it must stay torch's."""
    from optim._base import OptimizerBase

    opt, _ = _stepped_sgd()
    ours, torchs = OptimizerBase._packed_layout(opt), opt.state_dict()
    assert ours["param_groups"] == torchs["param_groups"]
    assert ours["state"].keys() == torchs["state"].keys()
    for k, st in torchs["state"].items():
        assert ours["state"][k].keys() == st.keys()
        assert all(torch.equal(ours["state"][k][n], v) for n, v in st.items())


def test_restored_layout_is_torchs_load():
    """``OptimizerBase._restore_layout`` is torch's ``load_state_dict`` without hooks: the same groups
    and state, and torch's refusals of another number of groups or a group of another size."""
    import pytest

    from optim._base import OptimizerBase

    source, _ = _stepped_sgd()
    sd = source.state_dict()
    theirs, their_params = _stepped_sgd()
    theirs.load_state_dict(sd)
    ours, params = _stepped_sgd()
    OptimizerBase._restore_layout(ours, sd, lambda p, saved: saved)
    options = [{k: v for k, v in g.items() if k != "params"} for g in theirs.param_groups]
    assert [{k: v for k, v in g.items() if k != "params"} for g in ours.param_groups] == options
    assert [q for g in ours.param_groups for q in g["params"]] == params
    for p, q in zip(params, their_params):
        assert ours.state[p].keys() == theirs.state[q].keys()
        assert all(torch.equal(ours.state[p][k], v) for k, v in theirs.state[q].items())
    for bad, message in (
            (dict(sd, param_groups=sd["param_groups"][:1]), "different number of parameter groups"),
            (dict(sd, param_groups=[dict(sd["param_groups"][0], params=[0]), sd["param_groups"][1]]),
             "doesn't match the size of optimizer's group")):
        with pytest.raises(ValueError, match=message):
            OptimizerBase._restore_layout(ours, bad, lambda p, saved: saved)
        with pytest.raises(ValueError, match=message):
            theirs.load_state_dict(bad)


def test_sparse_parts_are_the_stored_uncoalesced_entries():
    idx = torch.tensor([[2, 0, 2]])
    vals = torch.randn(3, 4)
    g = torch.sparse_coo_tensor(idx, vals, (5, 4), check_invariants=True)
    indices, values = tp.sparse_parts(g)
    assert torch.equal(indices, idx) and torch.equal(values, vals)  # duplicates kept, in order


def test_version_counter_counts_in_place_changes():
    t = torch.zeros(3)
    before = tp.version_counter(t)
    t.add_(1)
    t[1:].mul_(2)  # through a view
    assert tp.version_counter(t) == before + 2
