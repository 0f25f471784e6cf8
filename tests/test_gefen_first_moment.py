"""The first moment every backend stores is the reference's exactly: scales and codes bit for bit.

Scales and codes depend only on the gradient and the stored (scales, codes), not on p or v (whose
sums and square roots may round differently per backend), so they must agree exactly. The
reference's ``lerp`` is torch's, one FMA (``w * (g - m) + m``, rounded once); an unfused
``m + w * (g - m)`` is off by a rounding, which moves a value across a code boundary.

* The smallest such input: two elements, codebook ``linspace(-1, 1, 256)``, scale 1; element 0
  (code 255, g = 1) keeps the scale at 1, element 1 (old code 122, i.e. m = C[122]) with the
  gradient below lands on code 110 fused and 111 unfused.
* Random states and gradients over several steps: ``test_gefen_kernels.py``.
"""

import pytest
import torch

from optim.gefen import numba_ops, torch_ops, triton_ops
from optim.gefen import reference as R
from optim.gefen.plan import Hyper, Tile
from tests.test_gefen_kernels import HP

STEPS = [pytest.param(torch_ops.gefen_step_, id="torch"), pytest.param(numba_ops.gefen_step_, id="numba"),
         pytest.param(triton_ops.gefen_step_, id="triton")]
G1 = float.fromhex("-0x1.e3e3ep-1")  # element 1's gradient: fused and unfused lerp straddle a boundary


@pytest.mark.parametrize("step_", STEPS)
def test_lerp_is_fused_as_the_reference(step_):
    cb = torch.linspace(-1, 1, 256)
    g = torch.tensor([1.0, G1])
    scales, codes = torch.ones(1), torch.tensor([255, 122], dtype=torch.uint8)
    m_old = cb[codes.long()]
    w = torch.tensor(1 - HP["beta1"], dtype=torch.float32)
    fused = (w.double() * (g - m_old).double() + m_old.double()).float()  # w*d exact in float64
    unfused = m_old + w * (g - m_old)
    want = (fused[:, None] - cb[None, :]).abs().argmin(dim=1)  # brute-force nearest, scale is 1
    assert torch.equal(m_old.lerp(g, 1 - HP["beta1"]), fused)  # torch's lerp is the fused one
    assert want.tolist() == [255, 110]
    assert (unfused[1:, None] - cb[None, :]).abs().argmin(dim=1).tolist() == [111]  # the trap
    _, rv, rs, rc = R.gefen_step(torch.zeros(2), g, torch.zeros(2), scales.clone(), codes.clone(), cb,
                                 step=2, block=1, bits=8, **HP)
    assert rc.tolist() == [255, 110] and rs.tolist() == [1.0]
    p, v, s, c = torch.zeros(2), torch.zeros(2), scales.clone(), codes.clone()
    step_([Tile(p, v, s, c)], [g], cb, Hyper(2, **HP), block=1, bits=8)
    assert c.tolist() == [255, 110]
    assert s.tolist() == [1.0]
