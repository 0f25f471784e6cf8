"""Gefen(..., capturable=True): the step count, lr and bias corrections on the device.

A capturable step is one ``_gefen_hyper_kernel`` launch a parameter group (it advances each
parameter's fp32 step counter and writes each tensor's row of step scalars: ``1 - lr*wd``,
``-lr / (1 - beta1**t)``, ``sqrt(1 - beta2**t)`` and the stochastic-rounding seed) and the step
kernels, which read those rows instead of host arguments. Checked here on CPU tensors under
TRITON_INTERPRET=1:

- the rows hold exactly the fp32 numbers the host path passes (float64 on the host, rounded once),
  for every step up to ``STEPS_CHECKED`` at several betas; the device raises ``beta**t`` by binary
  powering where the host calls the C library's ``pow`` (within a few float64 ulps of each other),
  so the documented bound is one fp32 ulp, and equality is what these steps show;
- so ten capturable steps equal ten host-path steps bit for bit: 8-bit, 4-bit, factored, the 8-bit
  compact layout (row-group scales, v shared on vectors, bf16 factors per tile rounded with step seeds
  the step scalars' launch writes on the device), an fp32 first moment, bf16 weights with stochastic
  rounding, maximize, a tensor lr changed by an LR scheduler, and under ``step_in_backward``;
- after the first step (which chooses blocks and learns the codebook on the host) a step reads
  no tensor value on the host: no ``aten::_local_scalar_dense`` or other data-dependent operation
  (``experiments.harness.op_count.OpCount``) and no call of ``Tensor.item``, ``__float__``, ``__int__``,
  ``__bool__``, ``cpu``, ``tolist`` or ``numpy`` outside the kernel launches (the interpreter
  itself moves tensors inside a launch); nor does the host path with a float lr;
- state dicts move between capturable and host-step optimizers both ways and continue exactly;
  a parameter off the Triton path is refused by name; a replaced lr tensor is read, with one plan.

With CUDA and compiled kernels (TRITON_INTERPRET=0; ``experiments/gpu_checks.sh``), a step captured
in a CUDA graph and replayed equals eager steps bit for bit, with the gradients static and with
them made by a backward inside the graph; skipped otherwise.
"""

import collections
import math
import os

import pytest
import torch

from experiments.harness.op_count import OpCount
from optim import Gefen, GefenLayout
from optim.gefen.layout import FIELDS
from optim._rounding import step_seed
from optim.gefen import state as K, triton_ops

STEPS_CHECKED = 3000
SHAPES = [(24, 48), (7, 13), (300,), (64, 64)]
VARIANTS = {
    "8bit": dict(layout="published"),
    "4bit": dict(bits=4, layout="published"),
    "factored": dict(layout="factored"),
    "factored-4bit": dict(layout="factored", bits=4),
    "compact": dict(layout="compact"),  # bf16 factors per tile (their step seeds on the device)
    "fp32-m": dict(layout=GefenLayout(quantize_first_moment=False)),
    "bf16-sr": dict(stochastic_rounding=True, dtype=torch.bfloat16, layout="published"),
    "maximize": dict(maximize=True, layout="published"),
}
HOST_READS = ("item", "__float__", "__int__", "__bool__", "__index__", "cpu", "tolist", "numpy")


def _host_scalars(step, lr, beta1, beta2, wd):
    """The fp32 numbers the host path passes the step kernels (``triton_ops._kernel_args``)."""
    one = torch.ones(1, dtype=torch.int64)
    args, _ = triton_ops._kernel_args(one, one, one, None, one, step=step, lr=lr, beta1=beta1, beta2=beta2,
                                      eps=1e-8, weight_decay=wd)
    return torch.tensor(args[-4:-1], dtype=torch.float32)  # decay, neg_step, sqrt_bc2, rounded as Triton does


@pytest.mark.parametrize("lr, betas, wd", [(1e-3, (0.9, 0.999), 0.1), (3e-4, (0.95, 0.9999), 0.0),
                                           (0.1, (0.5, 0.99), 1e-4), (7e-5, (0.0, 0.98), 0.05)])
def test_device_scalars_are_the_hosts(lr, betas, wd):
    counters = torch.arange(STEPS_CHECKED, dtype=torch.float32)  # before the launch: t = 1 .. STEPS_CHECKED
    seeds = [(12345 * i) % 2**32 for i in range(STEPS_CHECKED)]
    tiles = [None if i % 3 else i % 7 for i in range(STEPS_CHECKED)]
    sc = triton_ops.StepScalars(list(counters.unbind(0)), seeds, tiles, "cpu")
    triton_ops.advance_(sc, lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=wd)
    assert torch.equal(counters, torch.arange(1, STEPS_CHECKED + 1, dtype=torch.float32))
    host = torch.stack([_host_scalars(t, lr, *betas, wd) for t in range(1, STEPS_CHECKED + 1)])
    diff = (sc.buf[:, :3] != host).any(dim=1).nonzero().flatten().tolist()
    assert not diff, f"steps {[d + 1 for d in diff[:5]]}: device {sc.buf[diff[0], :3]} host {host[diff[0]]}"
    words = sc.bits[:, 3].tolist()
    for i, (seed, tile) in enumerate(zip(seeds, tiles)):
        per = step_seed(seed, 0, i + 1)
        want = per if tile is None else step_seed(per, tile, 0)
        assert words[i] % 2**32 == want, f"row {i}: seed {words[i] % 2**32}, expected {want}"


def test_a_counter_shared_by_tiles_advances_once_and_a_tensor_lr_is_read_on_the_device():
    counter = torch.tensor(4.0)
    sc = triton_ops.StepScalars([counter] * 3, [None] * 3, [0, 1, 2], "cpu")
    lr = torch.tensor(2e-3)
    triton_ops.advance_(sc, lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.1)
    assert counter.item() == 5.0
    assert torch.equal(sc.buf[:, :3], _host_scalars(5, lr.item(), 0.9, 0.999, 0.1).expand(3, 3))
    lr.fill_(5e-4)
    triton_ops.advance_(sc, lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.1)
    assert counter.item() == 6.0
    assert torch.equal(sc.buf[0, :3], _host_scalars(6, lr.item(), 0.9, 0.999, 0.1))


def _pair(variant, lr=1e-2, wd=0.1, shapes=SHAPES, **extra):
    """Parameters and Gefen twins, host steps and capturable, from one seed."""
    kw = dict(VARIANTS[variant], **extra)
    dtype = kw.pop("dtype", torch.float32)
    torch.manual_seed(0)
    init = [torch.randn(s).to(dtype) for s in shapes]
    out = []
    for capturable in (False, True):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        rate = lr.clone() if torch.is_tensor(lr) else lr
        out.append((params, Gefen(params, lr=rate, weight_decay=wd, backend="triton", capturable=capturable, **kw)))
    return out


def _grads(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g).to(p.dtype) for p in params] for _ in range(steps)]


def _set(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _step(opt):
    """``opt.step()``; its first draws the stochastic-rounding seed from torch's generator, seeded
    the same for every twin."""
    if not opt.state:
        torch.manual_seed(7)
    opt.step()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_capturable_steps_equal_host_steps_bit_for_bit(variant):
    """Ten steps, a tensor lr that an LR scheduler lowers after each (the host path reads it with
    ``float``, the capturable one on the device): the same weights and state, bit for bit."""
    (ps_h, host), (ps_c, cap) = _pair(variant, lr=torch.tensor(1e-2))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.8**k) for o in (host, cap)]
    for grads in _grads(ps_h, 10):
        for ps, opt, sched in ((ps_h, host, scheds[0]), (ps_c, cap, scheds[1])):
            _set(ps, grads)
            _step(opt)
            sched.step()
    for i, (a, b) in enumerate(zip(ps_h, ps_c)):
        assert torch.equal(a, b), f"parameter {i}: max |diff| {(a.float() - b.float()).abs().max()}"
        sa, sb = host.state[a], cap.state[b]
        assert sa[K.STEP] == 10 and torch.is_tensor(sb[K.STEP]) and sb[K.STEP].dtype == torch.float32
        assert sb[K.STEP].item() == 10.0
        for key in K.PER_PARAM_TENSORS:
            if key in sa:
                assert torch.equal(sa[key], sb[key]), f"parameter {i}: state {key!r}"


class _HostReads:
    """Counts what reads a tensor's value on the host outside Triton launches: the data-dependent
    aten operations ``OpCount`` counts as host synchronisations, and calls of ``HOST_READS``."""

    def __enter__(self):
        self.ops = OpCount().__enter__()
        self.calls = collections.Counter()
        self._saved = []
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved.append((name, name in torch.Tensor.__dict__, original))

            def wrapped(t, *args, _name=name, _original=original, **kwargs):
                if not self.ops._in_launch:
                    self.calls[_name] += 1
                return _original(t, *args, **kwargs)
            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, own, original in reversed(self._saved):
            if own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)
        return self.ops.__exit__(*exc)


@pytest.mark.parametrize("capturable, lr", [(True, "tensor"), (True, "float"), (False, "float")],
                         ids=["capturable-tensor-lr", "capturable-float-lr", "host-steps-float-lr"])
@pytest.mark.parametrize("variant", ["8bit", "4bit", "factored", "compact", "bf16-sr"])
@pytest.mark.parametrize("static_grads", [True, False], ids=["static-grads", "new-grads"])
def test_no_host_reads_after_the_first_step(variant, capturable, lr, static_grads):
    """Steps 2..5 read no tensor value on the host. With gradients at fixed addresses a capturable
    step also issues no torch operation at all: only launches, one ``_gefen_hyper_kernel`` and
    the step's kernels (new gradient tensors cost one small pointer copy a call)."""
    pairs = _pair(variant, lr=torch.tensor(1e-2) if lr == "tensor" else 1e-2)
    params, opt = pairs[1] if capturable else pairs[0]
    grads = _grads(params, 5)
    _set(params, grads[0])
    opt.step()
    for k in range(1, 5):
        if static_grads:
            for p, g in zip(params, grads[k]):
                p.grad.copy_(g)
        else:
            _set(params, grads[k])
        with _HostReads() as reads:
            opt.step()
        assert reads.ops.host_syncs == 0 and not reads.calls, (reads.ops.summary(), dict(reads.calls))
        kernels = dict(reads.ops.kernels)
        assert kernels.get("_gefen_hyper_kernel", 0) == (1 if capturable else 0), kernels
        if capturable and static_grads:
            assert reads.ops.device_ops == 0, reads.ops.summary()
    assert opt.state[params[0]][K.STEP] == 5


@pytest.mark.parametrize("variant", ["8bit", "factored-4bit", "bf16-sr", "compact"])
def test_state_dicts_move_between_capturable_and_host_steps(variant, tmp_path):
    """Saved after 3 steps, loaded (``map_location="cpu"``) into the other kind, 3 more steps: the
    same as 6 uninterrupted steps of either, both ways; the saved step is a float32 tensor from a
    capturable optimizer (torch's convention) and an int from the other."""
    (ps_h, host), (ps_c, cap) = _pair(variant)
    grads = _grads(ps_h, 6)
    for k in range(3):
        for ps, opt in ((ps_h, host), (ps_c, cap)):
            _set(ps, grads[k])
            _step(opt)
    sd_h, sd_c = host.state_dict(), cap.state_dict()
    assert isinstance(sd_h["state"][0][K.STEP], int)
    assert sd_c["state"][0][K.STEP].dtype == torch.float32 and sd_c["state"][0][K.STEP].item() == 3
    torch.save(sd_h, tmp_path / "host.pt")
    torch.save(sd_c, tmp_path / "cap.pt")
    (ps_h2, host2), (ps_c2, cap2) = _pair(variant)  # fresh optimizers, fresh weights set to the saved ones
    for dst, src in ((ps_h2, ps_c), (ps_c2, ps_h)):
        for d, s in zip(dst, src):
            d.data.copy_(s.data)
    host2.load_state_dict(torch.load(tmp_path / "cap.pt", map_location="cpu"))
    cap2.load_state_dict(torch.load(tmp_path / "host.pt", map_location="cpu"))
    assert isinstance(host2.state[ps_h2[0]][K.STEP], int)
    assert torch.is_tensor(cap2.state[ps_c2[0]][K.STEP])
    for k in range(3, 6):
        for ps, opt in ((ps_h, host), (ps_c, cap), (ps_h2, host2), (ps_c2, cap2)):
            _set(ps, grads[k])
            opt.step()
    for ps in (ps_c, ps_h2, ps_c2):
        for i, (a, b) in enumerate(zip(ps_h, ps)):
            assert torch.equal(a, b), f"parameter {i}"


def test_a_block_handed_to_torch_is_refused_by_name(monkeypatch):
    """What only the data decide (``triton_ops.data_refusal``: a block longer than one program)
    would put a parameter on the torch step: under capturable its first step refuses it by name."""
    params = [torch.nn.Parameter(torch.randn(8, 16))]
    opt = Gefen(params, layout="published", backend="triton", capturable=True)
    monkeypatch.setattr(triton_ops, "data_refusal", lambda **kw: "a stand-in refusal")
    params[0].grad = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"capturable=True for parameter 0 of group 0 \(shape \(8, 16\), block"):
        opt.step()


def test_a_replaced_lr_tensor_or_float_is_read_with_one_plan():
    """The plan's key holds no lr: a new lr tensor object, or a float in its place, is what the
    next step reads, and the plan is reused."""
    (ps_h, host), (ps_c, cap) = _pair("8bit", lr=torch.tensor(1e-2))
    rates = [torch.tensor(1e-2), torch.tensor(3e-3), 2e-3, torch.tensor(5e-4, dtype=torch.float64), 1e-3]
    for grads, rate in zip(_grads(ps_h, 5), rates):
        for ps, opt in ((ps_h, host), (ps_c, cap)):
            opt.param_groups[0]["lr"] = rate.clone() if torch.is_tensor(rate) else rate
            _set(ps, grads)
            _step(opt)
    assert len(cap._plans) == 1
    for a, b in zip(ps_h, ps_c):
        assert torch.equal(a, b)


def test_step_in_backward_steps_capturable_parameters_as_host_steps():
    """Each parameter stepped in its own hook (``optim.step_in_backward``): every parameter reads
    its own device counter, so the steps equal the host path's bit for bit."""
    from optim import step_in_backward

    out = []
    for capturable in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = Gefen(model.parameters(), layout="published", lr=1e-2, backend="triton", capturable=capturable)
        handle = step_in_backward(opt)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        handle.remove()
        assert all(opt.state[p][K.STEP] == 4 for p in model.parameters())
        out.append(list(model.parameters()))
    for i, (a, b) in enumerate(zip(*out)):
        assert torch.equal(a, b), f"parameter {i}"


def test_capturable_is_an_option_of_every_group_and_survives_pickling():
    params = [torch.nn.Parameter(torch.randn(8, 8))]
    opt = Gefen(params, layout="published", backend="triton", capturable=True)
    assert opt.defaults["capturable"] is True and opt.param_groups[0]["capturable"] is True
    params[0].grad = torch.randn(8, 8)
    opt.step()
    import copy

    twin = copy.deepcopy(opt)
    assert twin.capturable and torch.is_tensor(twin.state[twin.param_groups[0]["params"][0]][K.STEP])
    kwargs = {k: v for k, v in opt.state_dict()["param_groups"][0].items() if k != "params"}
    again = Gefen(params, layout=GefenLayout(**{k: kwargs.pop(k) for k in FIELDS}), **kwargs)
    assert again.capturable


# ----------------------------------------------------------------------------------- CUDA graphs
_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
needs_cuda = pytest.mark.skipif(not _CUDA, reason="CUDA graphs need CUDA and compiled Triton kernels "
                                                  "(TRITON_INTERPRET=0); experiments/gpu_checks.sh runs these")


@needs_cuda
@pytest.mark.parametrize("variant", ["8bit", "factored-4bit", "bf16-sr"])
def test_cuda_graph_replays_a_captured_step_as_eager_steps(variant):
    """Three eager steps (blocks, codebook, plan) on a side stream, one ``opt.step()`` captured with
    the gradients at fixed addresses, 7 replays with new gradient values copied in and a tensor lr
    that an LR scheduler lowers between replays: the weights and state equal 10 eager host-path
    steps bit for bit."""
    dev = torch.device("cuda")
    kw = dict(VARIANTS[variant])
    dtype = kw.pop("dtype", torch.float32)
    torch.manual_seed(0)
    shapes = [(256, 384), (384,), (96, 100), (1000,), (64, 64)]
    init = [torch.randn(s, device=dev).to(dtype) for s in shapes]
    ps_g = [torch.nn.Parameter(x.clone()) for x in init]
    ps_e = [torch.nn.Parameter(x.clone()) for x in init]
    opt_g = Gefen(ps_g, lr=torch.tensor(1e-2, device=dev), weight_decay=0.1, capturable=True, **kw)
    opt_e = Gefen(ps_e, lr=torch.tensor(1e-2, device=dev), weight_decay=0.1, **kw)
    sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.8**k) for o in (opt_g, opt_e)]
    grads = [[torch.randn(s, device=dev).to(dtype) for s in shapes] for _ in range(10)]
    static = [torch.zeros(s, device=dev, dtype=dtype) for s in shapes]
    for p, g in zip(ps_g, static):
        p.grad = g

    def eager(k):
        _set(ps_e, grads[k])
        _step(opt_e)
        sched[1].step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(3):
            for g, x in zip(static, grads[k]):
                g.copy_(x)
            _step(opt_g)
            sched[0].step()
            eager(k)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_g.step()
    for k in range(3, 10):
        for g, x in zip(static, grads[k]):
            g.copy_(x)
        graph.replay()
        sched[0].step()
        eager(k)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(ps_e, ps_g)):
        assert torch.equal(a, b), f"parameter {i}: max |diff| {(a.float() - b.float()).abs().max()}"
        assert opt_g.state[b][K.STEP].item() == 10.0 and opt_e.state[a][K.STEP] == 10
        for key in K.PER_PARAM_TENSORS:
            if key in opt_e.state[a]:
                assert torch.equal(opt_e.state[a][key], opt_g.state[b][key]), f"parameter {i}: {key!r}"


@needs_cuda
def test_cuda_graph_of_a_whole_training_step():
    """Forward, backward and ``opt.step()`` in one graph, the gradients made inside it
    (``zero_grad(set_to_none=True)`` before the capture, as torch's whole-network example): each
    replay's update equals an eager host-path step on the same gradients, bit for bit."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).to(dev)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = Gefen(model.parameters(), lr=1e-2, weight_decay=0.1, capturable=True, layout="factored")
    opt_e = Gefen(twin, lr=1e-2, weight_decay=0.1, layout="factored")
    x, y = torch.randn(16, 64, device=dev), torch.randn(16, 32, device=dev)

    def follow():  # the eager twin steps on the gradients the graph's model just made
        _set(twin, [p.grad for p in model.parameters()])
        opt_e.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            follow()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for k in range(6):
        x.copy_(torch.randn(16, 64, device=dev))
        graph.replay()
        torch.cuda.synchronize()
        # the replay stepped from the twin's weights with these gradients: step the twin with them
        follow()
        for i, (a, b) in enumerate(zip(twin, model.parameters())):
            assert torch.equal(a, b), f"replay {k}, parameter {i}: max |diff| {(a - b).abs().max()}"
    assert all(math.isclose(opt.state[p][K.STEP].item(), 9.0) for p in model.parameters())
