"""The ``@triton.jit`` kernels of Gefen's fused step; launched by ``triton_ops.py``.

Why the kernel looks the way it does
------------------------------------
* One pass over memory. Per element the step reads g, p and the code and writes p and the code;
  per block it reads and writes v and the scale. Everything (v update, weight decay, dequantise,
  lerp, block absmax, requantise, parameter update) happens on a tile held in registers: a program
  owns whole scale blocks, so the block reductions need no second pass and no atomics. Bytes per
  element: 2 x p's size + g's size + 2 x the code's (1 byte at 8 bits, half at 4): 14 for fp32 p
  and g with 8-bit codes, 13 with 4-bit codes, 8 for bf16 p and g with 8-bit codes; plus 16 bytes
  per block (v and the scale). Upstream's CUDA path runs the block mean of g**2 and the weight
  decay as separate kernels (two more reads of g and a read+write of p) and launches one CUDA
  block of >= 32 threads per Gefen block, so a block length of 8 leaves 3/4 of its threads idle.
* Tile = R whole blocks x next_pow2(S) columns, R*next_pow2(S) ~ ``TILE`` = 2048 elements, with
  ``ELEMS_PER_THREAD`` = 4 elements a thread (16 warps). Lanes past S (non-power-of-two S) are
  masked: they cost registers, not memory traffic. At 4 elements a thread every configuration stays
  within 64 registers (at least half the warps of an sm_90 SM resident, to hide HBM latency); 8
  needed more. tests/test_triton_aot.py compiles configurations covering every value of every
  planning axis for sm_80, sm_90 and sm_100 and asserts that occupancy on sm_90;
  experiments/kernel_resources.py reports every pair of values.
* Vectorised accesses. Pointers read from the pointer table carry no alignment the compiler can
  see, and a mask ``offs < n`` with n read from memory is not constant over 4 lanes: either alone
  makes every global load and store scalar. So a launch whose tensors are all 16-byte aligned says
  so (``tl.multiple_of``, ALIGN) and one whose sizes are whole tile rows masks by row (EXACT):
  then p, g, v and codes move in 128-bit accesses. Misaligned or ragged tensors (FSDP shards at
  odd offsets, a P = 1 tensor whose size is not a multiple of 256) go to their own scalar launch
  (``experiments/bench_kernels.py`` times both).
* Nearest codebook entry without scanning the entries: ``codebook.code_table``'s lookup table over
  uniform bins of [-1, 1] (the one every fast path reads), built once per codebook on the host
  over the distinct entries. ``lut[j]`` is the number of boundaries left of bin j (less the
  table's margin for the rounding of the bin index), so the answer is ``lut[j]`` plus the number
  of boundaries in the bin that x exceeds: ``NCMP`` comparisons, 1 for every codebook learned
  from a 4096-bin histogram (one uint8 read of a table of at most 64 KB and one read of a 1 KB
  boundary table), against 8 dependent reads for a binary search over 255 boundaries. Equal
  entries (a codebook padded because fewer histogram bins were occupied than levels) are merged
  in the table; the code written is then the copy the reference's rule picks (first copy from
  below, last from above).
* 4-bit codes are packed two a byte, so a program works on pairs of elements (even, odd) and
  writes whole bytes; no two programs share a byte. Elements are loaded as one contiguous tile and
  split into (even, odd) in registers: loads of the evens and the odds with stride 2 compile to
  scalar accesses, the contiguous tile to 128-bit ones. For an odd block length a byte straddles
  two blocks, so a tile row then holds two blocks (2S elements) reduced separately.
* Bias corrections, ``1 - lr*wd`` and ``1 - beta1`` are computed on the host in float64 and passed
  as fp32 scalars. With HYPER (``Gefen(capturable=True)``) the step-dependent ones (``1 - lr*wd``,
  ``-lr / (1 - beta1**t)``, ``sqrt(1 - beta2**t)``) and the stochastic-rounding seed are read from a
  row per tensor that ``_gefen_hyper_kernel`` writes on the device each step from the step counters
  (float64, from the hyper-parameters' exact bits, rounded to fp32 once: the host's numbers), so a
  launch captured in a CUDA graph stays right at every replay; each is read where it is used, so it
  holds no register through the tile's work. Torch's ``lerp`` (two branches on the weight, each one
  FMA as torch evaluates it on the CPU and CUDA) and ``addcdiv`` order are followed, and divisions
  and square roots are
  the IEEE-rounded ``tl.div_rn`` / ``tl.sqrt_rn`` (plain ``/`` and ``tl.sqrt`` compile to
  ``div.full``/``div.approx`` and ``sqrt.approx.ftz`` on sm_90). Other FMA contraction is off
  (``enable_fp_fusion=False``; torch rounds each operation). So scales and codes equal the
  reference's exactly (they depend only on g and the stored first moment), and p and v agree to
  fp32 rounding (the block sum of g**2 is added in another order); the kernel is memory-bound,
  so the extra arithmetic is hidden behind its memory traffic.
* Row-group scales (one scale per S = k P elements, ``row_group_scales``): a tile row is still one
  scale block, its k v blocks each in next_pow2(P) lanes of its own (``SUB``, ``WP``), so the v
  sums are one reshaped reduction and the scale's absmax the row's, as before; the padding lanes
  are masked (at most 4x the live ones, for P and k just past powers of two).
* The factored second moment's per-offset factor ``w`` needs a reduction over every block of a
  tensor before any block's step can read it, so it is two kernels launched before the step, each
  over every tensor of the call at once: ``_factor_stats_kernel`` sums g**2 per offset over a
  range of block rows (a program's rows in a loop, its partial sums into a scratch row of its own:
  no atomics, so the sums do not depend on the order programs run in), and
  ``_factor_finalize_kernel`` adds each tensor's partial rows in a fixed order and updates w in
  place (a bf16 w, ``W16``, in fp32, stored rounded stochastically). A statistics program sums ``FACTOR_ITERS`` iterations of rows, and at least
  ``FACTOR_ROWS`` rows (a tensor's last program fewer), so the scratch holds S floats per tensor
  and beyond that at most 1/``FACTOR_ROWS`` of the gradients' elements. Alignment is read from the
  gradient's address at run time (one branch a program), so misaligned tiles cost no launch of
  their own.
"""

import torch
import triton
import triton.language as tl

from .._triton_common import hash32, round_bf16, round_stochastic

TILE = 2048  # elements per program (R blocks x next_pow2(S) lanes); see module docstring
ELEMS_PER_THREAD = 4  # sets num_warps (see module docstring)
MAX_TILE_WIDTH = 16384  # largest next_pow2(lanes) of a tile row in one program (triton_ops.data_refusal)
FACTOR_TILE = 2048  # elements a statistics program sums per loop iteration (R rows x BW offsets)
FACTOR_WIDTH = 2048  # most offsets of a block one statistics program holds (longer blocks: column chunks)
FACTOR_ITERS = 16  # loop iterations of a statistics program (its work beside its start and partial row) ...
FACTOR_ROWS = 128  # ... and at least this many block rows (bounds the scratch; module docstring)
FINAL_TILE = 1024  # partial sums a finalize program adds per loop iteration (IB items x FW offsets)
FINAL_WIDTH = 128  # most offsets one finalize program updates
HYPER_BLOCK = 128  # rows of step scalars _gefen_hyper_kernel writes per loop iteration
ROW_TAB_COLUMNS = tl.constexpr(5)  # int64 columns of _gefen_hyper_kernel's row table

# The columns of the step's pointer table (int64, a row per tensor, ``triton_ops._Plan.ptrs``): the
# addresses of p, g, v, scales, codes and of the unquantised first moment m (fp32); a tensor the call
# has not (scales and codes unquantised, m quantised) has address 0.
PTR_P, PTR_G, PTR_V, PTR_SCALES, PTR_CODES, PTR_M = (tl.constexpr(k) for k in range(6))
PTR_COLUMNS = tl.constexpr(6)

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _nearest(x, uniq_ptr, mid_ptr, lut_ptr, first_ptr, NLUT: tl.constexpr, NCMP: tl.constexpr,
             HAS_DUP: tl.constexpr):
    """(code, codebook value) of the nearest entry to x in [-1, 1]: one LUT read + NCMP compares."""
    j = ((x + 1.0) * (NLUT * 0.5)).to(tl.int32)  # x + 1 >= 0, so truncation is floor
    j = tl.minimum(tl.maximum(j, 0), NLUT - 1)
    u = tl.load(lut_ptr + j).to(tl.int32)
    for _ in tl.static_range(NCMP):
        u += (x > tl.load(mid_ptr + u)).to(tl.int32)  # mid is padded with +inf: u stays in range
    val = tl.load(uniq_ptr + u)
    if HAS_DUP:  # repeated entries: the code the reference's searchsorted rule picks (see host)
        code = tl.load(first_ptr + 2 * u + (x > val).to(tl.int32)).to(tl.int32)
    else:
        code = u
    return code, val


@triton.jit
def _lerp(m, g, w):
    """torch.lerp(m, g, w): torch's two branches, each one FMA as torch computes them (CPU:
    vectorised ``fmadd``; CUDA: nvcc contracts the formula), so the first moment, and with it
    the scales and codes, agree with the reference exactly. ``enable_fp_fusion=False`` would
    leave an unfused ``m + w * (g - m)``, off by a rounding that can move a code across a
    boundary."""
    d = g - m
    return tl.where(w < 0.5, tl.fma(w, d, m), tl.fma(w - 1.0, d, g))


@triton.jit
def _new_m(g, code, s_old, cb_ptr, w):
    return _lerp(tl.load(cb_ptr + code) * s_old, g, w)


@triton.jit
def _tensor_ptrs(ptr_tab, t, P_DT: tl.constexpr, G_DT: tl.constexpr, C_DT: tl.constexpr,
                 ALIGN: tl.constexpr, QUANT: tl.constexpr):
    """The tensor's pointers from the table (its named columns, ``PTR_P`` ...): p, g, v, scales and
    the first moment (codes where QUANT, else m; C_DT its dtype). ALIGN (all 16-byte aligned,
    checked by the launcher) declares the alignment the compiler cannot see in them (module
    docstring)."""
    base = ptr_tab + PTR_COLUMNS * t
    p_ptr = tl.load(base + PTR_P).to(tl.pointer_type(P_DT))
    g_ptr = tl.load(base + PTR_G).to(tl.pointer_type(G_DT))
    v_ptr = tl.load(base + PTR_V).to(tl.pointer_type(tl.float32))
    s_ptr = tl.load(base + PTR_SCALES).to(tl.pointer_type(tl.float32))
    if QUANT:
        c_ptr = tl.load(base + PTR_CODES).to(tl.pointer_type(C_DT))
    else:
        c_ptr = tl.load(base + PTR_M).to(tl.pointer_type(C_DT))
    if ALIGN:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        s_ptr = tl.multiple_of(s_ptr, 16)
        c_ptr = tl.multiple_of(c_ptr, 16)
    return p_ptr, g_ptr, v_ptr, s_ptr, c_ptr


@triton.jit
def _factored(v, w_tab, t, offs, mask, n, S: tl.constexpr, WIDTH: tl.constexpr, W16: tl.constexpr):
    """(v r_j, u) for block v ``v`` at block offsets ``offs`` of tensor t (n elements, blocks of S):
    r_j = w_j / mean(w) (1 where mean(w) == 0), the factored second moment's per-offset scale of v
    (``reference.factor_ratio``; w is already updated this step; W16: w is bf16, read as fp32), and
    the clip's cap ``min(S v, n_b w_j)`` (``reference.own_moment_cap``)."""
    w_ptr = tl.load(w_tab + t).to(tl.pointer_type(tl.bfloat16 if W16 else tl.float32))
    j = tl.arange(0, WIDTH)
    mean = tl.div_rn(tl.sum(tl.load(w_ptr + j, mask=j < S, other=0.0).to(tl.float32), axis=0), S * 1.0)
    wj = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.where(mean > 0, tl.div_rn(wj, tl.where(mean > 0, mean, 1.0)), 1.0)
    return v * r, tl.minimum(v * S, wj * (n // S).to(tl.float32))


@triton.jit
def _device_scalar(hyper_tab, t, k, value, HYPER: tl.constexpr):
    """``value`` (a launch argument), or with HYPER word k of tensor t's row of step scalars on the
    device (``hyper_tab``: one row address a tensor; ``_gefen_hyper_kernel`` wrote the row this step).
    Read where it is used, so that it holds no register through the tile's work."""
    if HYPER:
        return tl.load((tl.load(hyper_tab + t) + 4 * k).to(tl.pointer_type(tl.float32)))
    return value


@triton.jit
def _apply(p_ptr, offs, mask, m_hat, d, u, sqrt_bc2, eps, kb, decay, neg_step, seed_tab, hyper_tab, t,
           SR: tl.constexpr, HYPER: tl.constexpr):
    """p <- p * (1 - lr*wd); p <- p + (-lr/bc1) * m^ / (d + eps) (reference order), m^ clipped to
    ``kb * sqrt(u / bc2)`` (``kb = bound * sqrt(bc2)``, negative: no clip; ``d = sqrt(v / bc2)``;
    ``u`` the element's cap, ``reference.own_moment_cap``), stored in p's
    dtype: rounded to nearest, or with SR (bf16, fp16 p) stochastically with tensor t's seed
    (``seed_tab``, or with HYPER word 3 of its row of step scalars)."""
    decay = _device_scalar(hyper_tab, t, 0, decay, HYPER)
    neg_step = _device_scalar(hyper_tab, t, 1, neg_step, HYPER)
    lim = tl.where(kb >= 0, kb * tl.div_rn(tl.sqrt_rn(u), sqrt_bc2), float("inf"))
    m_hat = tl.where(tl.abs(m_hat) > lim, tl.where(m_hat > 0, lim, -lim), m_hat)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32) * decay
    p = p + tl.div_rn(neg_step * m_hat, d + eps)
    if SR:
        if HYPER:
            seed = tl.load((tl.load(hyper_tab + t) + 12).to(tl.pointer_type(tl.uint32)))
        else:
            seed = tl.load(seed_tab + t)
        p = round_stochastic(p, seed, offs, p_ptr.dtype.element_ty)
    elif p_ptr.dtype.element_ty == tl.bfloat16:
        p = round_bf16(p)
    tl.store(p_ptr + offs, p, mask=mask)


@triton.jit
def _gefen_step_kernel(
    tile_ptr, ptr_tab, numel_tab, cb_ptr, uniq_ptr, mid_ptr, lut_ptr, first_ptr, w_tab, seed_tab, hyper_tab,
    w, beta2, omb2, eps, decay, neg_step, sqrt_bc2, bound,
    P_DT: tl.constexpr, G_DT: tl.constexpr, C_DT: tl.constexpr,
    S: tl.constexpr, BLOCK_V: tl.constexpr, QUANT: tl.constexpr, R: tl.constexpr,
    WIDTH: tl.constexpr, NLUT: tl.constexpr, NCMP: tl.constexpr, HAS_DUP: tl.constexpr,
    ALIGN: tl.constexpr, EXACT: tl.constexpr, FACTOR: tl.constexpr, SR: tl.constexpr, HYPER: tl.constexpr,
    SUB: tl.constexpr = 1, WP: tl.constexpr = 1, W16: tl.constexpr = False,
):
    """8-bit codes or unquantised m: a tile of R scale blocks x WIDTH (>= S) element lanes.

    BLOCK_V == S: one v per scale block; BLOCK_V == 1: per-element v (then S == CHUNK and the
    last scale block of a tensor may be partial). FACTOR (BLOCK_V == S only): v of element j of
    a block is scaled by r_j of the tensor's factor w (``w_tab``: one pointer a tensor; fp32, or
    bf16 with W16).
    SUB > 1 (row-group scales): a scale block holds SUB v blocks of P = S / SUB elements, each in
    WP = next_pow2(P) lanes of its own (WIDTH = next_pow2(SUB) * WP; ``_sub_blocks``).
    """
    pid = tl.program_id(0)
    t = tl.load(tile_ptr + 2 * pid)
    row0 = tl.load(tile_ptr + 2 * pid + 1)
    n = tl.load(numel_tab + t)
    p_ptr, g_ptr, v_ptr, s_ptr, c_ptr = _tensor_ptrs(ptr_tab, t, P_DT, G_DT, C_DT, ALIGN, QUANT)

    rows = row0 + tl.arange(0, R)[:, None]  # [R, 1] scale-block index (int64)
    lane = tl.arange(0, WIDTH)[None, :]
    if SUB == 1:
        cols = lane  # the element's offset in its scale block, and in its v block
        live = cols < S
        offs = rows * S + cols
    else:
        cols = lane % WP
        live = (cols < S // SUB) & (lane // WP < SUB)
        offs = rows * S + (lane // WP) * (S // SUB) + cols
    if EXACT:  # n % S == 0: a mask constant along each row lets loads and stores be 128-bit
        mask = live & (rows * S < n)
    else:
        mask = live & (offs < n)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    if BLOCK_V == 1:
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        v = beta2 * v + omb2 * (g * g)
        tl.store(v_ptr + offs, v, mask=mask)
        u = v
    elif SUB == 1:
        rmask = rows * S < n
        v = tl.load(v_ptr + rows, mask=rmask, other=0.0)
        v = beta2 * v + omb2 * tl.div_rn(tl.sum(g * g, axis=1)[:, None], S * 1.0)
        tl.store(v_ptr + rows, v, mask=rmask)
        if FACTOR:
            v, u = _factored(v, w_tab, t, cols, live, n, S, WIDTH, W16)
        else:
            u = v * S
    else:
        v = _sub_blocks(g * g, v_ptr, rows, n, beta2, omb2, S, SUB, WP, R, WIDTH)
        if FACTOR:
            v, u = _factored(v, w_tab, t, cols, live, n, S // SUB, WP, W16)
        else:
            u = v * (S // SUB)
    sqrt_bc2 = _device_scalar(hyper_tab, t, 2, sqrt_bc2, HYPER)
    d = tl.div_rn(tl.sqrt_rn(v), sqrt_bc2)

    if QUANT:
        rmask = rows * S < n
        s_old = tl.load(s_ptr + rows, mask=rmask, other=0.0)
        code = tl.load(c_ptr + offs, mask=mask, other=0).to(tl.int32)
        m = tl.where(mask, _new_m(g, code, s_old, cb_ptr, w), 0.0)
        s_new = tl.max(tl.abs(m), axis=1)[:, None]
        tl.store(s_ptr + rows, s_new, mask=rmask)
        x = tl.div_rn(m, tl.where(s_new > 0, s_new, 1.0))  # m == 0 where s == 0
        code, val = _nearest(x, uniq_ptr, mid_ptr, lut_ptr, first_ptr, NLUT, NCMP, HAS_DUP)
        tl.store(c_ptr + offs, code.to(tl.uint8), mask=mask)
        m_hat = val * s_new
    else:
        m = tl.load(c_ptr + offs, mask=mask, other=0.0)
        m_hat = _lerp(m, g, w)
        tl.store(c_ptr + offs, m_hat, mask=mask)
    _apply(p_ptr, offs, mask, m_hat, d, u, sqrt_bc2, eps, bound * sqrt_bc2, decay, neg_step, seed_tab, hyper_tab, t,
           SR, HYPER)


@triton.jit
def _sub_blocks(gg, v_ptr, rows, n, beta2, omb2, S: tl.constexpr, SUB: tl.constexpr, WP: tl.constexpr,
                R: tl.constexpr, WIDTH: tl.constexpr):
    """Row-group scales: the v of each of a scale block's SUB v blocks (P = S / SUB elements, WP
    lanes each) updated from the tile's g**2 ``gg`` [R, WIDTH] and stored, returned per lane."""
    KP: tl.constexpr = WIDTH // WP
    sums = tl.reshape(tl.sum(tl.reshape(gg, [R * KP, WP]), axis=1), [R, KP])
    k = tl.arange(0, KP)[None, :]
    vmask = (k < SUB) & (rows * S < n)
    v = tl.load(v_ptr + rows * SUB + k, mask=vmask, other=0.0)
    v = beta2 * v + omb2 * tl.div_rn(sums, (S // SUB) * 1.0)
    tl.store(v_ptr + rows * SUB + k, v, mask=vmask)
    return tl.reshape(tl.broadcast_to(v[:, :, None], [R, KP, WP]), [R, WIDTH])


@triton.jit
def _pairs(x, R: tl.constexpr, WIDTH: tl.constexpr):
    """[R, 2*WIDTH] -> (even, odd) halves, each [R, WIDTH]."""
    return tl.split(tl.reshape(x, [R, WIDTH, 2]))


@triton.jit
def _unpairs(a, b, R: tl.constexpr, WIDTH: tl.constexpr):
    """Inverse of _pairs."""
    return tl.reshape(tl.join(a, b), [R, 2 * WIDTH])


@triton.jit
def _half_rows(a0, a1, sub0, sub1, IS_MAX: tl.constexpr):
    """Per-tile-row reductions over the elements of the first (sub == 0) and second block."""
    if IS_MAX:
        ra = tl.maximum(tl.max(tl.where(sub0, 0.0, a0), axis=1), tl.max(tl.where(sub1, 0.0, a1), axis=1))
        rb = tl.maximum(tl.max(tl.where(sub0, a0, 0.0), axis=1), tl.max(tl.where(sub1, a1, 0.0), axis=1))
    else:
        ra = tl.sum(tl.where(sub0, 0.0, a0), axis=1) + tl.sum(tl.where(sub1, 0.0, a1), axis=1)
        rb = tl.sum(tl.where(sub0, a0, 0.0), axis=1) + tl.sum(tl.where(sub1, a1, 0.0), axis=1)
    return ra[:, None], rb[:, None]


# The two kernels share one argument list (a deliberate duplicate of shape): the launcher calls
# either with the same arguments and constexprs; GROUP replaces QUANT for packed 4-bit codes.
@triton.jit
def _gefen_step4_kernel(
    tile_ptr, ptr_tab, numel_tab, cb_ptr, uniq_ptr, mid_ptr, lut_ptr, first_ptr, w_tab, seed_tab, hyper_tab,
    w, beta2, omb2, eps, decay, neg_step, sqrt_bc2, bound,
    P_DT: tl.constexpr, G_DT: tl.constexpr, C_DT: tl.constexpr,
    S: tl.constexpr, BLOCK_V: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr,
    WIDTH: tl.constexpr, NLUT: tl.constexpr, NCMP: tl.constexpr, HAS_DUP: tl.constexpr,
    ALIGN: tl.constexpr, EXACT: tl.constexpr, FACTOR: tl.constexpr, SR: tl.constexpr, HYPER: tl.constexpr,
    SUB: tl.constexpr = 1, WP: tl.constexpr = 1, W16: tl.constexpr = False,
):
    """Packed 4-bit codes: a tile of R rows x WIDTH byte lanes, each byte = elements (2k, 2k+1).

    A tile row holds GROUP scale blocks (GROUP = 2 when S is odd, so bytes never straddle rows);
    H = GROUP*S/2 bytes of a row are live. SUB > 1 (row-group scales, GROUP 1, P = S / SUB even):
    each of a scale block's SUB v blocks in WP = next_pow2(P) element lanes (WP / 2 byte lanes)
    of its own, as in ``_gefen_step_kernel``.
    """
    H: tl.constexpr = GROUP * S // 2
    pid = tl.program_id(0)
    t = tl.load(tile_ptr + 2 * pid)
    row0 = tl.load(tile_ptr + 2 * pid + 1)
    n = tl.load(numel_tab + t)
    p_ptr, g_ptr, v_ptr, s_ptr, c_ptr = _tensor_ptrs(ptr_tab, t, P_DT, G_DT, C_DT, ALIGN, True)

    rows = row0 + tl.arange(0, R)[:, None]
    k = tl.arange(0, WIDTH)[None, :]
    # Elements are loaded and stored as one contiguous [R, 2*WIDTH] tile and split into the
    # (even, odd) halves of each byte in registers (module docstring: vectorised accesses).
    e = tl.arange(0, 2 * WIDTH)[None, :]
    if SUB == 1:
        byte = rows * H + k
        live = k < H
        fe = rows * (2 * H) + e
        elive = e < 2 * H
    else:
        byte = rows * H + (2 * k // WP) * (S // SUB // 2) + (2 * k % WP) // 2
        live = (2 * k % WP < S // SUB) & (2 * k // WP < SUB)
        fe = rows * S + (e // WP) * (S // SUB) + e % WP
        elive = (e % WP < S // SUB) & (e // WP < SUB)
    f0 = 2 * byte
    if EXACT:  # n % (2H) == 0: row-constant masks (vectorised loads, see _gefen_step_kernel)
        m0 = live & (rows * (2 * H) < n)
        m1 = m0
        me = elive & (rows * (2 * H) < n)
    else:
        m0 = live & (f0 < n)
        m1 = live & (f0 + 1 < n)
        me = elive & (fe < n)
    if GROUP == 1:
        sub0 = k < 0  # all False: every element is in block `rows`
        sub1 = sub0
    else:
        sub0 = 2 * k >= S
        sub1 = 2 * k + 1 >= S
    blk0 = rows * GROUP + sub0.to(tl.int64)  # scale block of each element
    blk1 = rows * GROUP + sub1.to(tl.int64)
    g = tl.load(g_ptr + fe, mask=me, other=0.0).to(tl.float32)
    g0, g1 = _pairs(g, R, WIDTH)

    if SUB > 1:
        v = _sub_blocks(g * g, v_ptr, rows, n, beta2, omb2, S, SUB, WP, R, 2 * WIDTH)
        if FACTOR:
            v, u = _factored(v, w_tab, t, e % WP, elive, n, S // SUB, WP, W16)
        else:
            u = v * (S // SUB)
        v0, v1 = _pairs(v, R, WIDTH)
        u0, u1 = _pairs(u, R, WIDTH)
    elif BLOCK_V == 1:
        v0, v1 = _pairs(tl.load(v_ptr + fe, mask=me, other=0.0), R, WIDTH)
        v0 = beta2 * v0 + omb2 * (g0 * g0)
        v1 = beta2 * v1 + omb2 * (g1 * g1)
        tl.store(v_ptr + fe, _unpairs(v0, v1, R, WIDTH), mask=me)
        u0, u1 = v0, v1
    else:
        va, vb = _half_rows(g0 * g0, g1 * g1, sub0, sub1, False)
        ba = rows * GROUP
        ma = ba * S < n
        mb = (GROUP == 2) & ((ba + 1) * S < n)
        va = beta2 * tl.load(v_ptr + ba, mask=ma, other=0.0) + omb2 * tl.div_rn(va, S * 1.0)
        vb = beta2 * tl.load(v_ptr + ba + 1, mask=mb, other=0.0) + omb2 * tl.div_rn(vb, S * 1.0)
        tl.store(v_ptr + ba, va, mask=ma)
        tl.store(v_ptr + ba + 1, vb, mask=mb)
        v0 = tl.where(sub0, vb, va)
        v1 = tl.where(sub1, vb, va)
        if FACTOR:  # offset of each element in its block: 2k (+1), less S in a row's second block
            v0, u0 = _factored(v0, w_tab, t, 2 * k - S * sub0.to(tl.int32), k < H, n, S, 2 * WIDTH, W16)
            v1, u1 = _factored(v1, w_tab, t, 2 * k + 1 - S * sub1.to(tl.int32), k < H, n, S, 2 * WIDTH, W16)
        else:
            u0, u1 = v0 * S, v1 * S
    sqrt_bc2 = _device_scalar(hyper_tab, t, 2, sqrt_bc2, HYPER)
    d0 = tl.div_rn(tl.sqrt_rn(v0), sqrt_bc2)
    d1 = tl.div_rn(tl.sqrt_rn(v1), sqrt_bc2)

    packed = tl.load(c_ptr + byte, mask=m0, other=0).to(tl.int32)
    s0 = tl.load(s_ptr + blk0, mask=m0, other=0.0)
    s1 = tl.load(s_ptr + blk1, mask=m1, other=0.0)
    a0 = tl.where(m0, _new_m(g0, packed & 15, s0, cb_ptr, w), 0.0)
    a1 = tl.where(m1, _new_m(g1, (packed >> 4) & 15, s1, cb_ptr, w), 0.0)
    sa, sb = _half_rows(tl.abs(a0), tl.abs(a1), sub0, sub1, True)
    ba = rows * GROUP
    tl.store(s_ptr + ba, sa, mask=ba * S < n)
    tl.store(s_ptr + ba + 1, sb, mask=(GROUP == 2) & ((ba + 1) * S < n))
    s0 = tl.where(sub0, sb, sa)
    s1 = tl.where(sub1, sb, sa)
    q0, val0 = _nearest(tl.div_rn(a0, tl.where(s0 > 0, s0, 1.0)), uniq_ptr, mid_ptr, lut_ptr, first_ptr,
                        NLUT, NCMP, HAS_DUP)
    q1, val1 = _nearest(tl.div_rn(a1, tl.where(s1 > 0, s1, 1.0)), uniq_ptr, mid_ptr, lut_ptr, first_ptr,
                        NLUT, NCMP, HAS_DUP)
    q1 = tl.where(m1, q1, 0)  # odd n: the last high nibble is padding 0
    tl.store(c_ptr + byte, (q0 | (q1 << 4)).to(tl.uint8), mask=m0)
    _apply(p_ptr, fe, me, _unpairs(val0 * s0, val1 * s1, R, WIDTH), _unpairs(d0, d1, R, WIDTH),
           _unpairs(u0, u1, R, WIDTH), sqrt_bc2, eps, bound * sqrt_bc2, decay, neg_step, seed_tab, hyper_tab, t,
           SR, HYPER)


@triton.jit
def _sum_squares(g_ptr, row0, row1, cols, cmask, S: tl.constexpr, R: tl.constexpr, BW: tl.constexpr):
    """Sum over block rows row0..row1-1 of g**2 at block offsets ``cols`` ([1, BW]): R rows an
    iteration, each lane adding its rows in order, then one tree sum over the R lanes."""
    acc = tl.zeros([R, BW], dtype=tl.float32)
    for r in range(row0, row1, R):
        rows = r + tl.arange(0, R)[:, None]
        g = tl.load(g_ptr + rows * S + cols, mask=cmask & (rows < row1), other=0.0).to(tl.float32)
        acc += g * g
    return tl.sum(acc, axis=0)


@triton.jit
def _factor_stats_kernel(item_tab, ptr_tab, part_ptr, G_DT: tl.constexpr, S: tl.constexpr,
                         R: tl.constexpr, BW: tl.constexpr):
    """Partial column sums of g**2: program (i, c) sums block rows [row0, row1) of tensor t (its
    n elements seen as (n / S, S)) at offsets c*BW .. c*BW + BW - 1 of the blocks, into row
    ``slot`` of the (slots, S) fp32 scratch ``part_ptr``. ``item_tab``: (t, row0, row1, slot) a
    program; ``ptr_tab``: the step's (T, ``PTR_COLUMNS``) pointer table, g in column ``PTR_G``."""
    pid = tl.program_id(0)
    t = tl.load(item_tab + 4 * pid)
    row0 = tl.load(item_tab + 4 * pid + 1)
    row1 = tl.load(item_tab + 4 * pid + 2)
    slot = tl.load(item_tab + 4 * pid + 3)
    cols = tl.program_id(1) * BW + tl.arange(0, BW)
    cmask = cols < S
    g_addr = tl.load(ptr_tab + PTR_COLUMNS * t + PTR_G)
    # 128-bit loads where the address is aligned (S keeps the rows so). The pointer is made in each
    # branch: multiple_of marks the operation that defines its argument, wherever that is used.
    if g_addr % 16 == 0:
        g_ptr = tl.multiple_of(g_addr.to(tl.pointer_type(G_DT)), 16)
        part = _sum_squares(g_ptr, row0, row1, cols[None, :], cmask[None, :], S, R, BW)
    else:
        g_ptr = g_addr.to(tl.pointer_type(G_DT))
        part = _sum_squares(g_ptr, row0, row1, cols[None, :], cmask[None, :], S, R, BW)
    tl.store(part_ptr + slot * S + cols, part, mask=cmask)


@triton.jit
def _factor_finalize_kernel(fin_tab, numel_tab, w_tab, part_ptr, seed_tab, beta2, omb2, S: tl.constexpr,
                            IB: tl.constexpr, FW: tl.constexpr, W16: tl.constexpr = False,
                            SEED_AT: tl.constexpr = False):
    """w <- beta2*w + (1 - beta2) * colsum / rows at offsets c*FW .. c*FW + FW - 1 of tensor t
    (program (t, c)), keeping an offset's old w where the new one is not finite
    (``reference.factor_update``). colsum: the tensor's ``count`` scratch rows from ``first``
    (``fin_tab``: (first, count) a tensor) added IB at a time in a fixed order. W16: w is bf16,
    updated in fp32 and stored rounded stochastically with tensor t's seed (``seed_tab``; SEED_AT:
    the address of an int64 seed on the device, which ``_gefen_hyper_kernel`` writes each step) and
    the words of its offsets (``reference.factor_update``); without it ``seed_tab`` is unused."""
    t = tl.program_id(0)
    first = tl.load(fin_tab + 2 * t)
    count = tl.load(fin_tab + 2 * t + 1)
    rows = (tl.load(numel_tab + t) // S).to(tl.float32)
    j = tl.program_id(1) * FW + tl.arange(0, FW)
    jmask = j < S
    acc = tl.zeros([IB, FW], dtype=tl.float32)
    for i in range(0, count, IB):
        items = i + tl.arange(0, IB)[:, None]
        acc += tl.load(part_ptr + (first + items) * S + j[None, :], mask=(items < count) & jmask[None, :],
                       other=0.0)
    mean = tl.div_rn(tl.sum(acc, axis=0), rows)
    w_ptr = tl.load(w_tab + t).to(tl.pointer_type(tl.bfloat16 if W16 else tl.float32))
    w = tl.load(w_ptr + j, mask=jmask, other=0.0).to(tl.float32)
    new = beta2 * w + omb2 * mean
    new = tl.where(tl.abs(new) < float("inf"), new, w)
    if W16:
        if SEED_AT:
            seed = tl.load(tl.load(seed_tab + t).to(tl.pointer_type(tl.int64)))
        else:
            seed = tl.load(seed_tab + t)
        new = round_stochastic(new, seed, j, tl.bfloat16)
    tl.store(w_ptr + j, new, mask=jmask)


@triton.jit
def _f64(bits):
    """The float64 whose IEEE bits are the int ``bits`` (a host float passed exactly: a Python float
    argument reaches a kernel as fp32)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _powers(b1, b2, t, BLOCK: tl.constexpr):
    """(b1**t, b2**t) in float64 by binary powering over the 25 low bits of int32 ``t`` (fp32 step
    counters are exact below 2**24): fixed IEEE multiplications, so the interpreter and every GPU
    give the same bits."""
    r1 = tl.full([BLOCK], 1.0, tl.float64)
    r2 = tl.full([BLOCK], 1.0, tl.float64)
    for k in tl.static_range(25):
        bit = ((t >> k) & 1) != 0
        r1 = tl.where(bit, r1 * b1, r1)
        r2 = tl.where(bit, r2 * b2, r2)
        b1 = b1 * b1
        b2 = b2 * b2
    return r1, r2


@triton.jit
def _tile_seed(c, t, k):
    """``optim._rounding.step_seed(seed, 0, t)`` from its constant ``c = hash32(hash32(seed))`` (uint32),
    then ``step_seed(that, k, 0)`` where tile index k >= 0 (uint32 results)."""
    per = hash32(c + t.to(tl.uint32) * 0x9E3779B9)
    tile = hash32(hash32(hash32(per) ^ k.to(tl.uint32)))
    return tl.where(k >= 0, tile, per)


@triton.jit(do_not_specialize=["n_rows", "lr_bits", "b1_bits", "b2_bits", "wd_bits"])
def _gefen_hyper_kernel(row_tab, out_ptr, seed_out, factor_seed_out, lr_ptr, n_rows: tl.int32, lr_bits: tl.int64,
                        b1_bits: tl.int64, b2_bits: tl.int64, wd_bits: tl.int64, LR_ON_DEVICE: tl.constexpr,
                        SR: tl.constexpr, FACTOR_SR: tl.constexpr, BLOCK: tl.constexpr):
    """One program: advance the step counters of a group's tensors and write each tensor's row of
    step scalars, ``[1 - lr*wd, -lr / (1 - beta1**t), sqrt(1 - beta2**t), seed]`` (fp32, the seed's
    32 bits through ``seed_out``, the same buffer as int32), which the step kernels read with HYPER.

    ``row_tab``: (n_rows, 5) int64 a row: address of its parameter's fp32 step counter, 1 where this
    row advances it (one row a counter: a parameter's tiles share it), the stochastic-rounding seed
    constant ``hash32(hash32(seed))``, the tile index (-1 for a whole tensor) and the bf16 factor's
    seed constant (its stream's, ``plan.FACTOR_STREAM``), whose step seed FACTOR_SR writes to
    ``factor_seed_out`` (int64 a row). t = counter + 1.
    The scalars are computed in float64 from the hyper-parameters' exact bits, as the host computes
    them, and rounded to fp32 once; lr is read from ``lr_ptr`` (LR_ON_DEVICE) or given. All rows
    read their counters before any is written (a barrier between the two loops: one program)."""
    b1 = _f64(b1_bits)
    b2 = _f64(b2_bits)
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = _f64(lr_bits)
    decay = (1.0 - lr * _f64(wd_bits)).to(tl.float32)
    for start in range(0, n_rows, BLOCK):
        r = start + tl.arange(0, BLOCK)
        m = r < n_rows
        addr = tl.load(row_tab + ROW_TAB_COLUMNS * r, mask=m, other=0)
        step = tl.load(addr.to(tl.pointer_type(tl.float32)), mask=m, other=0.0) + 1.0
        t = step.to(tl.int32)
        p1, p2 = _powers(b1, b2, t, BLOCK)
        tl.store(out_ptr + 4 * r, tl.full([BLOCK], 0.0, tl.float32) + decay, mask=m)
        tl.store(out_ptr + 4 * r + 1, ((-lr) / (1.0 - p1)).to(tl.float32), mask=m)
        tl.store(out_ptr + 4 * r + 2, tl.sqrt(1.0 - p2).to(tl.float32), mask=m)
        k = tl.load(row_tab + ROW_TAB_COLUMNS * r + 3, mask=m, other=-1)
        if SR:  # optim._rounding.step_seed(seed, 0, t), then step_seed(that, tile, 0) for a tile
            c = tl.load(row_tab + ROW_TAB_COLUMNS * r + 2, mask=m, other=0).to(tl.uint32)
            tl.store(seed_out + 4 * r + 3, _tile_seed(c, t, k).to(tl.int32, bitcast=True), mask=m)
        if FACTOR_SR:  # the same on the factor's stream, as an int64 of 32 bits
            c = tl.load(row_tab + ROW_TAB_COLUMNS * r + 4, mask=m, other=0).to(tl.uint32)
            tl.store(factor_seed_out + r, _tile_seed(c, t, k).to(tl.int64), mask=m)
    tl.debug_barrier()
    for start in range(0, n_rows, BLOCK):
        r = start + tl.arange(0, BLOCK)
        m = r < n_rows
        addr = tl.load(row_tab + ROW_TAB_COLUMNS * r, mask=m, other=0).to(tl.pointer_type(tl.float32))
        writes = tl.load(row_tab + ROW_TAB_COLUMNS * r + 1, mask=m, other=0) != 0
        tl.store(addr, tl.load(addr, mask=m & writes, other=0.0) + 1.0, mask=m & writes)
