"""The ``@numba.njit`` bodies of Gefen's CPU step; launched by ``numba_ops.py``.

Layout: one call per step for all tensors of a group (same block length and step). Python
passes a table of raw data addresses (``meta``: a row per tensor, the named columns below:
addresses of p, g, v, and of the codes and scales or of the unquantised first moment m, and
sizes) and a job table (tensor, first and last scale block); jobs run in parallel
(``prange``, numba threads = ``torch.get_num_threads()``). A job is a run of whole scale blocks,
so every block's v, absmax and codes are computed exactly as in the serial loop (results do not
depend on the thread count); with 4-bit codes and an odd scale-block length, jobs start at even
blocks so that no two jobs write the same code byte. A job's scratch (a few block-sized buffers)
lives on its thread's stack, so a job allocates nothing; the call's lookup tables are built once
(``_tables``).

Every compiled function is top level with one signature: the code width, ``block == 1`` and an
unquantised first moment are run-time flags tested once per scale block, not per element; the
instruction set (``_SIMD``) is a constant, so only its form of the passes is compiled. Top-level
functions have one on-disk cache entry each, so processes compiling at the same time cannot load
each other's variants.

A scale block (S <= 1024 elements, so its buffers stay in L1) goes through a few passes. Its
table lookups are what costs: on x86 a gather is a load an element whichever way it is done
(scalar loads or vgather), against a fraction of an instruction for the arithmetic around it. So
there are two forms of the passes, chosen by the CPU numba compiles for; they give the same
codes, scales, p and v bit for bit (``experiments/gefen_speed.py`` times the step against
``torch.optim.AdamW``).

AVX-512 (the CPU has AVX-512 F, BW and VBMI: ``_SIMD``): the passes are LLVM IR (``_v*``
intrinsics) over groups of 128 elements, a block's last 127 or fewer in groups of 64 with masked
loads and stores (nothing outside the block is read or written). The 256 codebook entries are
held as 4 byte planes and looked up with byte permutes, 64 at a time (``_lut256_ir``); the 16
entries of 4 bits are one register (vpermps).

1. decode, lerp, absmax and v's sum (``_vdecode8``/``_vdecode4``): C[code] * s, lerp with g (one
   FMA, torch's formula), max |m| as an integer max over the bit patterns (exact: for
   non-negative floats the integer order is the float order, and a NaN stays the largest), g**2
   into 64 lane sums (added in a fixed tree after the block: ``_vsum``);
2. codes and their entries (``_vquantize8``): q = m / absmax (an exact division), q's bin in
   ``codebook.nearest_code``'s table, the code below the bin (byte permutes over the 1024 bins;
   larger tables: scalar lookups and ``_vchoose8``), that code's boundary, code = below + (q >
   boundary), C[code]; at 4 bits (``_vquantize4``) the code is #{boundaries < q} by a binary
   search over the 15 boundaries in a register;
3. the parameter update (a vector loop) and, at 4 bits, packing two codes a byte.

Lines 2048 elements ahead are prefetched into L2 a few per group (the passes over a block are too
far apart for the hardware prefetcher to run ahead of them; a burst of prefetches a block would be
dropped).

Portable (any other CPU; plain numba loops that LLVM vectorises):

1. decode, lerp and absmax in one vector loop whose lookup is a gather from a copy of the
   codebook on the stack (so LLVM knows the stores cannot change it); 4 bits: nibbles unpacked
   first;
2. v's sum: 64 lanes, a row of 64 at a time, then a fixed tree;
3. 8 bits: q and its bin (vector), then code = lower code + (q > boundary) with both read from
   one uint64 a bin, and C[code] (the only scalar loop); 4 bits: the count of boundaries below q
   as compares and blends over boundaries held in registers (vector);
4. the parameter update (vector), 4-bit packing; the next blocks prefetched one block at a time.

With block == 1 (S = 256) v is per element, updated in the parameter-update loop. An
unquantised first moment (fp32 m in place of codes and scales) takes the portable lerp on the
stored m and the update.

Arithmetic: as ``reference.gefen_step`` in fp32, scalars passed as float32, no fast-math flags:
multiply-adds are fused only where written (``_fma``, ``llvm.fma``) and only where the
reference's value does not depend on it, so the serial and the parallel copy of a kernel round
alike. The decode ``C[code] * s`` is rounded before the lerp as torch rounds it; ``lerp`` is
torch's vectorised CPU lerp (an FMA); v's sum of squares is a chain of FMAs per lane in a fixed
order (not torch's order: v is equal to fp32 rounding); p can differ from the reference in the
last bits (block > 1: the update is ``m^ * (value / denom)``, one division per block; block == 1:
sqrt(v) times 1 / sqrt(bc2)). Codes do not depend on that: the lookup table's margin absorbs the
rounding of the bin index, the final boundary comparison is on the exact quotient, and the 4-bit
count ``#{boundaries < q}`` is ``codebook.nearest_code``'s definition.
"""

import functools
from functools import partial

import numpy as np
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from llvmlite import ir

_I8, _I32 = ir.IntType(8), ir.IntType(32)
# The columns of the address table ``meta`` (int64, a row per tensor, ``numba_ops._addresses``): the
# addresses of p (fp32, contiguous), g (contiguous, fp32 or bf16), v, scales (fp32), codes (uint8)
# and of the unquantised fp32 first moment m, then the element counts of p (and of g and m), v,
# scales and codes, and G_BF16: 1 where g is bf16 (widened to fp32 a scale block at a time into
# stack scratch: exact, so the step is the one on g.float()). A tensor the call has not (scales and
# codes unquantised, m quantised) has address 0 and count 0.
P_ADDR, G_ADDR, V_ADDR, SCALES_ADDR, CODES_ADDR, M_ADDR = 0, 1, 2, 3, 4, 5
NUMEL, V_NUMEL, SCALES_NUMEL, CODES_NUMEL, G_BF16 = 6, 7, 8, 9, 10
ADDRESS_COLUMNS = 11

MAX_S = 1024  # longest scale block with stack scratch (partition.MAX_BLOCK); longer ones get heap arrays
_LANES = 64  # lane sums of v's sum of squares
_TABLE = 256  # entries of the portable path's stack copy of the codebook
_AHEAD = 2  # scale blocks prefetched ahead (portable path)
_AHEAD_ELEMENTS = 2048  # elements prefetched ahead (AVX-512 path)
_GROUP = 128  # elements an AVX-512 call works on: two vectors of 64 bytes, each table register serving both
_PAD = _GROUP  # scratch past S: the AVX-512 calls work on whole groups
_BUF = MAX_S + _PAD
_CB_PLANES, _BOUND_PLANES, _CB16, _BOUNDS16, _TABS = 0, 1024, 2048, 2112, 2176  # byte offsets in ``tabs``


@functools.cache
def kernel(bits: int, per_element_v: bool, parallel: bool = True, factored: bool = False, quant: bool = True):
    """The compiled step for 8- or 4-bit codes and block == 1 (per-element v) or block > 1.

    ``parallel=False``: the same jobs run in order on the calling thread, without starting
    numba's OpenMP pool (at one thread its barrier would only add waiting).

    ``factored``: the second moment of element j of a block is ``v_b * r_j`` (block > 1), with
    ``ratio[t, j] = sqrt(r_j)`` and ``ratio[t, block] = sqrt(n_b mean(w))`` (the clip's column cap).

    ``quant=False``: the first moment is ``meta``'s ``M_ADDR`` (fp32, one float an element), updated
    in place; scales, codes, codebook and tables are not read (``bits`` is ignored).

    ``kernel(...)(meta, jobs, ratio, cb, bounds, lut_code, lut_bound, lut_values, lut_scale, block,
    S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, kb)``: ``meta`` int64 (tensors,
    ``ADDRESS_COLUMNS``): the address table (its named columns above); ``jobs`` int64 (jobs, 3) =
    tensor row, first scale block, end scale block; ``cb`` the codebook's distinct entries, ``bounds`` its fp32 decision boundaries
    (``CodeTable.boundaries``: levels - 1 and a trailing +inf), ``lut_code``/``lut_bound`` the
    table's lower code and boundary a bin (``lut_values`` is not read: the entries come from
    ``cb``); ``ratio`` fp32 (tensors, block + 1), ``factor_kernel``'s output (read only when
    ``factored``). ``kb``: the clip's ``bound * sqrt(bc2)`` (inf: none), times the square root of the
    element's cap ``reference.own_moment_cap`` over bc2.
    """
    return partial(_step_parallel if parallel else _step_serial, quant and bits == 4, per_element_v,
                   factored and not per_element_v, quant)


def factor_kernel(parallel: bool = True):
    """The factored second moment's first pass: ``(meta, jobs, wptrs, seeds, block, S, beta2,
    one_minus_beta2, partial, ratio)`` updates each tensor's ``w`` (address ``wptrs[t]``, ``block``
    fp32 floats; with ``seeds``, one int64 a tensor, bf16 ones, updated in fp32 and stored rounded
    stochastically with ``round_bf16_stochastic``, offsets 0 .. block - 1) with the mean over its
    blocks of g**2 per offset and writes ``ratio[t, :block] = sqrt(w / mean(w))`` of the stored w (ones
    where the mean is 0; what the step multiplies by) and ``ratio[t, block] = sqrt(n_b mean(w))``, n_b
    the tensor's blocks. Column sums run per job into ``partial`` (jobs, block) and are added per
    tensor in job order, so the result does not depend on the threads."""
    return _factor_parallel if parallel else _factor_serial


# ------------------------------------------------------------------------------ helpers
@intrinsic
def _typed_ptr(typingctx, dtype, addr):
    """A pointer to ``dtype`` elements (``np.float32``, ``np.uint8``, ...) at the integer address ``addr``."""
    sig = types.CPointer(dtype.instance_type)(dtype, types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[1], context.get_value_type(signature.return_type))
    return sig, codegen


@intrinsic
def _alloca(typingctx, dtype, n):
    """A pointer to ``n`` (a literal) elements of ``dtype`` on the calling function's stack."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    ty, size = dtype.instance_type, n.literal_value
    sig = types.CPointer(ty)(dtype, n)

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, context.get_value_type(ty), size=size)
    return sig, codegen


@intrinsic
def _data(typingctx, arr):
    """The address of an array's first element (``arr.ctypes.data`` spills the array's descriptor
    to memory, which then keeps LLVM from vectorising loops near the call)."""
    sig = types.intp(arr)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, context.get_value_type(types.intp))
    return sig, codegen


def _prefetch_ir(builder, addr, lines):
    """``llvm.prefetch`` (read, into L2: the block being worked on and its scratch fill L1) of
    ``lines`` cache lines from the integer address ``addr`` on."""
    fn = _declare(builder, "llvm.prefetch.p0", ir.VoidType(), [ir.PointerType(), _I32, _I32, _I32])
    for line in range(lines):
        p = builder.inttoptr(builder.add(addr, ir.Constant(addr.type, 64 * line)), ir.PointerType())
        builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 1), ir.Constant(_I32, 1)])


@intrinsic
def _prefetch(typingctx, addr):
    """Ask for the cache line at ``addr`` (an integer) ahead of its use."""
    def codegen(context, builder, signature, args):
        _prefetch_ir(builder, args[0], 1)
        return context.get_dummy_value()
    return types.void(addr), codegen


@intrinsic
def _prefetch8(typingctx, addr):
    """Ask for the 8 lines (512 bytes) from ``addr`` on."""
    def codegen(context, builder, signature, args):
        _prefetch_ir(builder, args[0], 8)
        return context.get_dummy_value()
    return types.void(addr), codegen


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _prefetch_block(p, g_addr, g_shift, codes, bits4, quant, start, stop):
    """Prefetch elements start..stop-1 of p, g (at ``g_addr``, elements of ``1 << g_shift`` bytes)
    and the codes (a scale block ``_AHEAD`` blocks on): the passes over a block are too far apart
    for the hardware prefetcher to run ahead of them."""
    for a in range(_data(p) + 4 * start, _data(p) + 4 * stop, 64):
        _prefetch(a)
    for a in range(g_addr + (start << g_shift), g_addr + (stop << g_shift), 64):
        _prefetch(a)
    if quant:
        lo, hi = (start >> 1, (stop + 1) >> 1) if bits4 else (start, stop)
        for a in range(_data(codes) + lo, _data(codes) + hi, 64):
            _prefetch(a)


@intrinsic
def _fma(typingctx, a, b, c):
    """a * b + c rounded once (``llvm.fma``: one instruction where the CPU has FMA)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)
    return sig, codegen


@intrinsic
def _low_f32(typingctx, x):
    """The float32 whose bit pattern is the low 32 bits of a uint64."""
    sig = types.float32(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())
    return sig, codegen


@intrinsic
def _bits_f32(typingctx, x):
    """The float32 whose bit pattern is the int32 x."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


# ------------------------------------------------------------------------- AVX-512 passes
# LLVM IR written with llvmlite (numba has no vector types). ``_SIMD`` says whether the compile
# target has the instructions; numba's cache is keyed by the CPU's features, so a cached kernel
# never runs on a CPU without them.

def _target_has(*features) -> bool:
    """Whether numba compiles for a CPU with all of ``features`` (LLVM's names)."""
    from numba.core.registry import cpu_target

    have = set(getattr(cpu_target.target_context.codegen(), "_tm_features", "").split(","))
    return all(f"+{f}" in have for f in features)


_SIMD = _target_has("avx512f", "avx512bw", "avx512vbmi")
_V64I8, _V16I32, _V16F32 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(ir.FloatType(), 16)


def _declare(builder, name, ret, args):
    """The declaration of the LLVM intrinsic ``name`` in the current module."""
    fn = builder.module.globals.get(name)
    return fn if fn is not None else ir.Function(builder.module, ir.FunctionType(ret, args), name=name)


def _consts(ty, values):
    return ir.Constant(ty, [ir.Constant(ty.element, int(x)) for x in values])


def _ptr(builder, addr, ty):
    return builder.inttoptr(addr, ty.as_pointer())


def _trap(builder):
    """The body of an intrinsic compiled for a CPU without AVX-512 (never called: ``_SIMD`` is False)."""
    builder.call(_declare(builder, "llvm.trap", ir.VoidType(), []), [])


def _splat(ty, x):
    return ir.Constant(ty, [ir.Constant(ty.element, x)] * ty.count)


def _load(builder, addr, ty, offset=0):
    """The ``ty`` vector at byte address ``addr`` + ``offset`` (unaligned)."""
    p = builder.add(addr, ir.Constant(addr.type, offset)) if offset else addr
    return builder.load(_ptr(builder, p, ty), align=1)


def _store(builder, value, addr, offset=0):
    p = builder.add(addr, ir.Constant(addr.type, offset)) if offset else addr
    builder.store(value, _ptr(builder, p, value.type), align=1)


def _lanes_below(builder, n, first, count, width=32):
    """The mask of ``count`` lanes first..first+count-1 that are below ``n`` (an i64)."""
    ty = ir.IntType(width)
    nv = builder.trunc(builder.select(builder.icmp_signed("<", n, ir.Constant(n.type, 255)), n,
                                      ir.Constant(n.type, 255)), ty)
    return builder.icmp_unsigned("<", _consts(ir.VectorType(ty, count), range(first, first + count)),
                                 _bcast(builder, nv, ir.VectorType(ty, count)))


def _masked_load(builder, addr, ty, mask, offset=0):
    """The ``ty`` vector at ``addr`` + ``offset`` where ``mask`` is set, 0 elsewhere (masked-off
    lanes are not read: no fault past the end of an array)."""
    p = builder.add(addr, ir.Constant(addr.type, offset)) if offset else addr
    name = f"llvm.masked.load.v{ty.count}{'f32' if ty.element == ir.FloatType() else f'i{ty.element.width}'}.p0"
    fn = _declare(builder, name, ty, [ir.PointerType(), _I32, mask.type, ty])
    return builder.call(fn, [builder.inttoptr(p, ir.PointerType()), ir.Constant(_I32, 1), mask, ir.Constant(ty, None)])


def _masked_store(builder, value, addr, mask, offset=0):
    p = builder.add(addr, ir.Constant(addr.type, offset)) if offset else addr
    ty = value.type
    name = f"llvm.masked.store.v{ty.count}{'f32' if ty.element == ir.FloatType() else f'i{ty.element.width}'}.p0"
    fn = _declare(builder, name, ir.VoidType(), [ty, ir.PointerType(), _I32, mask.type])
    builder.call(fn, [value, builder.inttoptr(p, ir.PointerType()), ir.Constant(_I32, 1), mask])


# Two unpack steps (bytes, then words, within 128-bit lanes) turn 4 byte planes into floats with
# element 16X + 4L + d at lane L, dword d of output X; the indices are permuted beforehand so that
# this is element order: byte 16L + 4X + d of the permuted indices is index 16X + 4L + d.
_LANE_ORDER = [16 * X + 4 * L + d for L in range(4) for X in range(4) for d in range(4)]


def _lut256_ir(builder, planes, idxs):
    """T[idx] for each vector of 64 byte indices in ``idxs`` and the 256-entry fp32 table T at
    address ``planes`` as 4 byte planes (byte k of entry e at 256 k + e): per vector, 4 vectors of
    16 floats. Each table register is loaded once for all of ``idxs``."""
    permb = _declare(builder, "llvm.x86.avx512.permvar.qi.512", _V64I8, [_V64I8, _V64I8])
    permi2b = _declare(builder, "llvm.x86.avx512.vpermi2var.qi.512", _V64I8, [_V64I8, _V64I8, _V64I8])
    idxs = [builder.call(permb, [idx, _consts(_V64I8, _LANE_ORDER)]) for idx in idxs]
    uppers = [builder.icmp_signed("<", idx, ir.Constant(_V64I8, None)) for idx in idxs]  # entries 128..255
    planes_out = [[] for _ in idxs]
    for k in range(4):
        t = [_load(builder, planes, _V64I8, 64 * (4 * k + q)) for q in range(4)]
        for out, idx, upper in zip(planes_out, idxs, uppers):
            out.append(builder.select(upper, builder.call(permi2b, [t[2], idx, t[3]]),
                                      builder.call(permi2b, [t[0], idx, t[1]])))

    def unpack(a, b, width, high):
        n, half = 64 // width, 8 // width
        lanes = ir.VectorType(ir.IntType(8 * width), n)
        a, b = builder.bitcast(a, lanes), builder.bitcast(b, lanes)
        order = [x for L in range(4) for j in range(half)
                 for x in (L * 2 * half + high * half + j, n + L * 2 * half + high * half + j)]
        return builder.shuffle_vector(a, b, _consts(ir.VectorType(_I32, n), order))

    result = []
    for p in planes_out:
        b01 = [unpack(p[0], p[1], 1, h) for h in (0, 1)]
        b23 = [unpack(p[2], p[3], 1, h) for h in (0, 1)]
        result.append([builder.bitcast(unpack(b01[h8], b23[h8], 2, h16), _V16F32)
                       for h8, h16 in ((0, 0), (0, 1), (1, 0), (1, 1))])
    return result


def _simd_intrinsic(body, returns=types.void):
    """The typer of an intrinsic whose first argument is the group size (a literal, 64 or 128) and
    whose others are integer addresses and scalars; its IR ``body(builder, group, args)`` needs
    AVX-512 (and returns an i32 where ``returns`` is int32). On a CPU without AVX-512 the body
    is a trap (``_SIMD`` keeps it from being called)."""
    def typer(typingctx, group, *args):
        if not isinstance(group, types.IntegerLiteral):
            return None

        def codegen(context, builder, signature, llargs):
            if not _SIMD:
                _trap(builder)
                out = ir.Constant(_I32, 0)
            else:
                out = body(builder, group.literal_value, llargs[1:])
            return out if returns is types.int32 else context.get_dummy_value()
        return returns(group, *args), codegen
    return typer


def _bcast(builder, x, ty):
    """A vector of ``ty`` holding the scalar ``x`` in every lane."""
    v = builder.insert_element(ir.Constant(ty, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, ty.count), None))


def _concat(builder, parts):
    """One vector of the 4 equal vectors ``parts``, in order."""
    n = parts[0].type.count
    lo = builder.shuffle_vector(parts[0], parts[1], _consts(ir.VectorType(_I32, 2 * n), range(2 * n)))
    hi = builder.shuffle_vector(parts[2], parts[3], _consts(ir.VectorType(_I32, 2 * n), range(2 * n)))
    return builder.shuffle_vector(lo, hi, _consts(ir.VectorType(_I32, 4 * n), range(4 * n)))


def _fma_ir(builder, a, b, c):
    return builder.call(_declare(builder, "llvm.fma.v16f32", _V16F32, [_V16F32] * 3), [a, b, c])


def _perm16(builder, table, idx):
    """table[idx] for a 16-entry fp32 table in a register (vpermps)."""
    fn = _declare(builder, "llvm.x86.avx512.permvar.sf.512", _V16F32, [_V16F32, _V16I32])
    return builder.call(fn, [table, idx])


def _code_below_ir(builder, qs, scale, lut):
    """lut[bin(q)] for each group of 64 floats in ``qs`` (4 vectors each) with ``_bins``' bin
    floor(q * s + s) (NaN and values past the ends in the last bin) and a 1024-entry byte table at
    ``lut``: 8 byte permutes of 128 entries each, then a select tree on the bin's bits 7-9."""
    permi2b = _declare(builder, "llvm.x86.avx512.vpermi2var.qi.512", _V64I8, [_V64I8, _V64I8, _V64I8])
    scale, top = _bcast(builder, scale, _V16F32), _splat(_V16F32, 1023.0)
    lows, segs = [], []
    for q in qs:
        bins = []
        for x in (_fma_ir(builder, v, scale, scale) for v in q):
            u = builder.fptoui(builder.select(builder.fcmp_ordered("<", x, top), x, top), _V16I32)  # no poison
            bins.append(builder.select(builder.fcmp_ordered(">=", x, _splat(_V16F32, 0.0)), u, _splat(_V16I32, 1023)))
        u = _concat(builder, bins)
        lows.append(builder.trunc(u, _V64I8))  # the permutes read its low 7 bits
        segs.append(builder.trunc(builder.lshr(u, _splat(u.type, 7)), _V64I8))
    rs = [[] for _ in qs]
    for k in range(8):
        t0, t1 = _load(builder, lut, _V64I8, 128 * k), _load(builder, lut, _V64I8, 128 * k + 64)
        for r, low in zip(rs, lows):
            r.append(builder.call(permi2b, [t0, low, t1]))
    out = []
    for r, seg in zip(rs, segs):
        for bit in (1, 2, 4):
            on = builder.icmp_unsigned("!=", builder.and_(seg, _splat(_V64I8, bit)), ir.Constant(_V64I8, None))
            r = [builder.select(on, r[2 * i + 1], r[2 * i]) for i in range(len(r) // 2)]
        out.append(r[0])
    return out


def _choose_ir(builder, qs, belows, tabs):
    """code = below + (q > B[below]) and its entry C[code] for each group of 64 (``tabs``: the
    tables of ``_tables``): per group the code (64 bytes) and 4 vectors of 16 floats."""
    bounds = _lut256_ir(builder, builder.add(tabs, ir.Constant(tabs.type, _BOUND_PLANES)), belows)
    codes = []
    for q, below, bound in zip(qs, belows, bounds):
        up = _concat(builder, [builder.fcmp_ordered(">", qx, bx) for qx, bx in zip(q, bound)])
        codes.append(builder.add(below, builder.zext(up, _V64I8)))
    return codes, _lut256_ir(builder, builder.add(tabs, ir.Constant(tabs.type, _CB_PLANES)), codes)


def _lerp_ir(builder, m0, g, w, small):
    """torch's lerp(m0, g, w1): fma(w1, g - m0, m0) (``small``: |w1| < 0.5) or fma(w1 - 1, g - m0, g)
    (``w`` holds w1 or w1 - 1)."""
    return _fma_ir(builder, w, builder.fsub(g, m0), builder.select(small, m0, g))


def _decode_ir(builder, values, g, args):
    """m = lerp(value * s, g, w1) for the decoded ``values`` and the gradients ``g`` (vectors of
    16), stored to m; acc[lane] += g**2 (fma; acc: 64 floats, lane i % 64) and max |m| as int32
    bits (0 for n == 0) over the first ``n`` lanes."""
    _, _, s, _, w, small, n, m, acc = args
    sv, wv = _bcast(builder, s, _V16F32), _bcast(builder, w, _V16F32)
    zero = ir.Constant(_V16I32, None)
    sums = [_load(builder, acc, _V16F32, 64 * X) for X in range(4)]
    top = zero
    for X, (v, gx) in enumerate(zip(values, g)):
        out = _lerp_ir(builder, builder.fmul(v, sv), gx, wv, small)
        _store(builder, out, m, 64 * X)
        live = _lanes_below(builder, n, 16 * X, 16)
        sums[X % 4] = builder.select(live, _fma_ir(builder, gx, gx, sums[X % 4]), sums[X % 4])
        bits = builder.select(live, builder.and_(builder.bitcast(out, _V16I32), _splat(_V16I32, 0x7FFFFFFF)), zero)
        top = builder.select(builder.icmp_signed(">", bits, top), bits, top)
    for X in range(4):
        _store(builder, sums[X], acc, 64 * X)
    return builder.call(_declare(builder, "llvm.vector.reduce.smax.v16i32", _I32, [_V16I32]), [top])


def _gradients(builder, g, n, count):
    """``count`` vectors of 16 gradients at ``g``, lanes from ``n`` on read as 0 (not read)."""
    return [_masked_load(builder, g, _V16F32, _lanes_below(builder, n, 16 * X, 16), 64 * X) for X in range(count)]


@intrinsic
def _vdecode8(typingctx, group, codes, tabs, s, g, w, small, n, m, acc):
    """A group of elements, 8 bits: m = lerp(C[code] * s, g, w1) (``_lerp_ir``) into ``m`` (a group
    of floats); over the first ``n``: acc[i % 64] += g**2 (``acc``: 64 floats) and returns max |m|
    as int32 bits. Codes and gradients from ``n`` on are not read (they count as 0)."""
    def body(builder, group, args):
        n = args[6]
        idxs = [_masked_load(builder, args[0], _V64I8, _lanes_below(builder, n, 64 * k, 64, 8), 64 * k)
                for k in range(group // 64)]
        planes = builder.add(args[1], ir.Constant(args[1].type, _CB_PLANES))
        values = [v for vs in _lut256_ir(builder, planes, idxs) for v in vs]
        return _decode_ir(builder, values, _gradients(builder, args[3], n, group // 16), args)
    return _simd_intrinsic(body, types.int32)(typingctx, group, codes, tabs, s, g, w, small, n, m, acc)


@intrinsic
def _vdecode4(typingctx, group, codes, tabs, s, g, w, small, n, m, acc):
    """``_vdecode8`` at 4 bits: ``codes`` one byte an element (a group of them readable), C a
    register (vpermps)."""
    def body(builder, group, args):
        cb = _load(builder, args[1], _V16F32, _CB16)
        values = [_perm16(builder, cb, builder.zext(_load(builder, args[0], ir.VectorType(_I8, 16), 16 * X), _V16I32))
                  for X in range(group // 16)]
        return _decode_ir(builder, values, _gradients(builder, args[3], args[6], group // 16), args)
    return _simd_intrinsic(body, types.int32)(typingctx, group, codes, tabs, s, g, w, small, n, m, acc)


def _store_codes(builder, codes, entries, out_codes, out_values, n):
    """The codes of a group to ``out_codes`` (the first ``n`` only), their entries to ``out_values``."""
    for k, (code, entry) in enumerate(zip(codes, entries)):
        _masked_store(builder, code, out_codes, _lanes_below(builder, n, 64 * k, 64, 8), 64 * k)
        for X, v in enumerate(entry):
            _store(builder, v, out_values, 256 * k + 64 * X)


@intrinsic
def _vquantize8(typingctx, group, m, div, scale, lut, tabs, codes, value, n):
    """A group, 8 bits: q = m / div (exact), code = lut[bin(q)] + (q > B[that code]) into ``codes``
    (the first ``n``) and C[code] into ``value`` (``codebook.nearest_code``'s table rule)."""
    def body(builder, group, args):
        m, div, scale, lut, tabs, codes, value, n = args
        dv = _bcast(builder, div, _V16F32)
        qs = [[builder.fdiv(_load(builder, m, _V16F32, 256 * k + 64 * X), dv) for X in range(4)]
              for k in range(group // 64)]
        _store_codes(builder, *_choose_ir(builder, qs, _code_below_ir(builder, qs, scale, lut), tabs), codes, value, n)
    return _simd_intrinsic(body)(typingctx, group, m, div, scale, lut, tabs, codes, value, n)


@intrinsic
def _vchoose8(typingctx, group, q, below, tabs, codes, value, n):
    """``_vquantize8`` after the division and the bin's lookup (``q``, ``below``: a group of floats
    and bytes in memory), for tables of more than 1024 bins."""
    def body(builder, group, args):
        q, below, tabs, codes, value, n = args
        qs = [[_load(builder, q, _V16F32, 256 * k + 64 * X) for X in range(4)] for k in range(group // 64)]
        belows = [_load(builder, below, _V64I8, 64 * k) for k in range(group // 64)]
        _store_codes(builder, *_choose_ir(builder, qs, belows, tabs), codes, value, n)
    return _simd_intrinsic(body)(typingctx, group, q, below, tabs, codes, value, n)


@intrinsic
def _vquantize4(typingctx, group, m, div, tabs, codes, value):
    """A group, 4 bits: q = m / div, code = #{boundaries < q} by a binary search over the 15 sorted
    boundaries (a NaN compares false everywhere: code 0, as the count) into ``codes`` (a byte an
    element), C[code] into ``value``."""
    def body(builder, group, args):
        m, div, tabs, codes, value = args
        dv = _bcast(builder, div, _V16F32)
        cb, bnd = _load(builder, tabs, _V16F32, _CB16), _load(builder, tabs, _V16F32, _BOUNDS16)
        for X in range(group // 16):
            q = builder.fdiv(_load(builder, m, _V16F32, 64 * X), dv)
            c = ir.Constant(_V16I32, None)
            for step in (8, 4, 2, 1):
                up = builder.fcmp_ordered(">", q, _perm16(builder, bnd, builder.add(c, _splat(_V16I32, step - 1))))
                c = builder.add(c, builder.select(up, _splat(_V16I32, step), ir.Constant(_V16I32, None)))
            _store(builder, builder.trunc(c, ir.VectorType(_I8, 16)), codes, 16 * X)
            _store(builder, _perm16(builder, cb, c), value, 64 * X)
    return _simd_intrinsic(body)(typingctx, group, m, div, tabs, codes, value)


@intrinsic
def _vsum(typingctx, group, acc):
    """The sum of the 64 floats at ``acc`` in a fixed tree: halves added as vectors, then pairs of
    lanes (``group`` unused: the calling convention of the others)."""
    def body(builder, group, args):
        v = [_load(builder, args[0], _V16F32, 64 * X) for X in range(4)]
        x = builder.fadd(builder.fadd(v[0], v[2]), builder.fadd(v[1], v[3]))
        for width in (8, 4, 2, 1):
            hi = builder.shuffle_vector(x, x, _consts(_V16I32, [(i + width) % 16 for i in range(16)]))
            x = builder.fadd(x, hi)
        return builder.bitcast(builder.extract_element(x, ir.Constant(_I32, 0)), _I32)
    return _simd_intrinsic(body, types.int32)(typingctx, group, acc)


# ------------------------------------------------------------------------------ passes
# Numba loops over block-sized slices (indices from 0, so numba adds no negative-index
# wrap-around, which kept LLVM from vectorising); inlined into ``_blocks``, so that LLVM sees the
# stack buffers they work on.

@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _decode_lerp(codes, table, s, g, w1, m):
    """m = lerp(table[code] * s, g, w1), torch's formula; returns max |m| as an int32 bit pattern.

    ``table`` is a copy of the codebook on the caller's stack: LLVM then knows that the stores
    cannot change it and vectorises the loop, the lookup included (a gather)."""
    bits = m.view(np.int32)
    a = np.int32(0)
    if abs(w1) < 0.5:
        for i in range(g.size):
            m0 = table[codes[i]] * s
            m[i] = _fma(w1, g[i] - m0, m0)
            a = max(a, np.int32(bits[i] & np.int32(0x7FFFFFFF)))
    else:
        w1m = w1 - np.float32(1.0)
        for i in range(g.size):
            gi = g[i]
            m0 = table[codes[i]] * s
            m[i] = _fma(w1m, gi - m0, gi)
            a = max(a, np.int32(bits[i] & np.int32(0x7FFFFFFF)))
    return a


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _lerp_fp32(g, w1, m):
    """m = lerp(m, g, w1) in place (the unquantised first moment)."""
    if abs(w1) < 0.5:
        for i in range(g.size):
            m0 = m[i]
            m[i] = _fma(w1, g[i] - m0, m0)
    else:
        w1m = w1 - np.float32(1.0)
        for i in range(g.size):
            gi = g[i]
            m[i] = _fma(w1m, gi - m[i], gi)


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _unpack4(codes, start, stop, out):
    """Nibble codes of elements start..stop-1 (two a byte, low nibble first) into ``out``."""
    i, o = start, 0
    if i & 1:
        out[0] = codes[i >> 1] >> 4
        i, o = i + 1, 1
    pairs = (stop - i) >> 1
    src, dst = codes[i >> 1:(i >> 1) + pairs], out[o:o + 2 * pairs]
    for k in range(pairs):
        b = src[k]
        dst[2 * k] = b & 15
        dst[2 * k + 1] = b >> 4
    if (stop - i) & 1:
        out[stop - start - 1] = codes[(stop - 1) >> 1] & 15


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _pack4(src_codes, start, stop, codes):
    """Inverse of ``_unpack4``; the other nibble of a shared end byte is kept."""
    i, o = start, 0
    if i & 1:
        k = i >> 1
        codes[k] = (codes[k] & 15) | (src_codes[0] << 4)
        i, o = i + 1, 1
    pairs = (stop - i) >> 1
    src, dst = src_codes[o:o + 2 * pairs], codes[i >> 1:(i >> 1) + pairs]
    for k in range(pairs):
        dst[k] = src[2 * k] | (src[2 * k + 1] << 4)
    if (stop - i) & 1:
        k = (stop - 1) >> 1
        codes[k] = (codes[k] & 240) | src_codes[stop - start - 1]


@njit(nogil=True, error_model="numpy", cache=True)
def _absmax_bits(bits, n):
    """max |x| over the first n floats, as an int32 bit pattern (vectorised integer max): the rule
    the decode passes apply on their way."""
    a = np.int32(0)
    for i in range(n):
        a = max(a, bits[i] & np.int32(0x7FFFFFFF))
    return a


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _sum_sq(g, acc):
    """sum(g**2): element i goes to lane i % 64 of ``acc`` (64 floats of scratch), whole rows of
    64 at a time (a vector loop over the lanes), then the lanes are added in a fixed tree.

    Vectorised without ``reassoc``: LLVM may order a ``reassoc`` sum differently in each
    compiled copy (serial and parallel kernels), which would break the bitwise equality of one
    and two threads.
    """
    for k in range(_LANES):
        acc[k] = np.float32(0.0)
    _sum_sq_into(g, acc)
    return _fold(acc)


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _sum_sq_into(g, acc):
    """``_sum_sq``'s lane sums added into ``acc`` (not cleared, not folded); a run of calls on
    consecutive pieces of whole lane rows adds as one call on the whole."""
    rows = g.size // _LANES
    for r in range(rows):
        gr = g[r * _LANES:(r + 1) * _LANES]
        for k in range(_LANES):
            acc[k] = _fma(gr[k], gr[k], acc[k])
    tail = g[rows * _LANES:]
    for k in range(tail.size):
        acc[k] = _fma(tail[k], tail[k], acc[k])


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _fold(acc):
    """The sum of the 64 lanes of ``acc`` in a fixed tree (destroys ``acc``)."""
    h = _LANES // 2
    while h >= 1:
        for k in range(h):
            acc[k] = acc[k] + acc[k + h]
        h //= 2
    return acc[0]


@njit(nogil=True, error_model="numpy", cache=True, inline="always")  # see _step_serial: no multiply-add choices
def _v_update_per_element(p, value, amax, v, g, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, kb):
    """v and p of block == 1; sqrt(v / bc2) as sqrt(v) * (1 / sqrt(bc2)): one division an element
    (equal to fp32 rounding). m^ is clipped to ``kb * sqrt(v / bc2)`` where ``kb`` is finite
    (``reference.gefen_step``'s bound; inf: no clip)."""
    inv_bc2_sqrt = np.float32(1.0) / bc2_sqrt
    clip = kb < np.float32(np.inf)
    for i in range(p.size):
        gi = g[i]
        vi = beta2 * v[i] + one_minus_beta2 * (gi * gi)
        v[i] = vi
        m_hat = value[i] * amax
        d = np.sqrt(vi) * inv_bc2_sqrt
        if clip:
            m_hat = _clip(m_hat, kb * d)
        p[i] = p[i] * decay + (neg_step * m_hat) / (d + eps)


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _clip(m, lim):
    """``m`` clipped to ``[-lim, lim]`` (``reference.clip_moment``: NaN stays NaN; NaN lim clips nothing)."""
    if abs(m) > lim:
        return lim if m > np.float32(0.0) else -lim
    return m


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _bins(m, n, amax, lut_scale, top, u):
    """q = m / amax in place (exact division; m == 0 where amax == 0) and q's table bin."""
    div = amax if amax > np.float32(0.0) else np.float32(1.0)
    for i in range(n):
        q = m[i] / div
        m[i] = q
        x = _fma(q, lut_scale, lut_scale)  # >= 0 for |q| <= 1; only q == 1 overflows the table
        u[i] = min(np.uint32(x), top) if x >= np.float32(0.0) else top  # NaN (an inf gradient): the last bin


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _lookup(codes, q, u, lut, table, value):
    """Code of q (``codebook.nearest_code``'s table, ``lut[bin]`` = the bin's boundary's bits |
    its lower code << 32: one load) into ``codes``, its entry ``table[code]`` into ``value``."""
    for i in range(codes.size):
        e = lut[u[i]]
        c = np.uint32(e >> np.uint64(32)) + np.uint32(q[i] > _low_f32(e))
        codes[i] = np.uint8(c)
        value[i] = table[c]


@njit(nogil=True, error_model="numpy", cache=True)
def _pack_lut(lut_code, lut_bound):
    """The table ``_lookup`` reads: boundary bits | code << 32, one uint64 a bin."""
    out = np.empty(lut_code.size, dtype=np.uint64)
    b = lut_bound.view(np.uint32)
    for i in range(out.size):
        out[i] = np.uint64(b[i]) | (np.uint64(lut_code[i]) << np.uint64(32))
    return out


@njit(nogil=True, error_model="numpy", cache=True)
def _lookup8(codes, m, u, lut_code, lut_bound, lut_values):
    """The 8-bit lookup after ``_bins`` (q in ``m``, bins in ``u``) on the tables of
    ``numba_ops._luts``, as the kernel does it (AVX-512: ``_vchoose8``, else ``_lookup``): codes
    into ``codes``, q -> its entry in place."""
    n = codes.size
    cb = np.zeros(lut_code.max() + 2, dtype=np.float32)
    bounds = np.full(cb.size, np.inf, dtype=np.float32)
    for b in range(lut_code.size):
        cb[lut_code[b]] = lut_values[2 * b]
        cb[lut_code[b] + 1] = lut_values[2 * b + 1]
        bounds[lut_code[b]] = lut_bound[b]
    lut, tabs, lut8 = _tables(True, cb, bounds, lut_code, lut_bound)
    value = np.zeros(n + _PAD, dtype=np.float32)
    if _SIMD:
        q = np.zeros(n + _PAD, dtype=np.float32)
        below = np.zeros(n + _PAD, dtype=np.uint8)
        for i in range(n):
            q[i] = m[i]
            below[i] = lut8[u[i]]
        for k in range(0, n, _GROUP):
            _vchoose8(_GROUP, _data(q) + 4 * k, _data(below) + k, _data(tabs), _data(codes) + k, _data(value) + 4 * k,
                      n - k)
    else:
        _lookup(codes, m, u, lut, cb, value)
    m[:n] = value[:n]


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _quantize4(m, n, amax, bounds, cb, codes):
    """4 bits: code = #{boundaries < m / amax} and its value C[code] (into m), vectorised.

    ``bounds`` (15 + 1 values) and ``cb`` (16) are tuples, unpacked into registers: over arrays
    the loop compiles to scalar code (their loads could alias the stores), over tuples to
    compares and blends.
    """
    div = amax if amax > np.float32(0.0) else np.float32(1.0)
    b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, _ = bounds
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = cb
    one = np.int32(1)
    for i in range(n):
        q = m[i] / div
        c = np.int32(0)
        v = c0
        if q > b0:
            c, v = c + one, c1
        if q > b1:
            c, v = c + one, c2
        if q > b2:
            c, v = c + one, c3
        if q > b3:
            c, v = c + one, c4
        if q > b4:
            c, v = c + one, c5
        if q > b5:
            c, v = c + one, c6
        if q > b6:
            c, v = c + one, c7
        if q > b7:
            c, v = c + one, c8
        if q > b8:
            c, v = c + one, c9
        if q > b9:
            c, v = c + one, c10
        if q > b10:
            c, v = c + one, c11
        if q > b11:
            c, v = c + one, c12
        if q > b12:
            c, v = c + one, c13
        if q > b13:
            c, v = c + one, c14
        if q > b14:
            c, v = c + one, c15
        codes[i] = np.uint8(c)
        m[i] = v


@njit(nogil=True, error_model="numpy", cache=True, inline="always")  # no contract: see _step_serial
def _update_shared(p, value, amax, decay, step_over_denom, lim):
    """One v for the block: m^ times ``neg_step / denom``, m^ clipped to ``lim`` (inf or NaN: none)."""
    clip = lim < np.float32(np.inf)
    for i in range(p.size):
        m_hat = value[i] * amax
        if clip:
            m_hat = _clip(m_hat, lim)
        p[i] = p[i] * decay + m_hat * step_over_denom


@njit(nogil=True, error_model="numpy", cache=True, inline="always")  # no contract: see _step_serial
def _update_factored(p, value, amax, sv, sr, decay, neg_step, eps, kb, ku, kc):
    """Block > 1, factored: denominator sqrt(v_b / bc2) * sqrt(r_j) + eps, with sqrt(r_j) from
    ``factor_kernel`` (one multiply a element where the reference takes a square root of v_b r_j:
    equal to fp32 rounding). Where ``kb`` is finite m^ is clipped to ``min(ku, kc * sqrt(r_j))``:
    ``kb`` times sqrt(min(P v_b, n_b w_j) / bc2) (``reference.own_moment_cap``), with ``ku = kb
    sqrt(P) sv`` and ``kc = kb sqrt(n_b mean(w) / bc2)``."""
    clip = kb < np.float32(np.inf)
    for i in range(p.size):
        m_hat = value[i] * amax
        d = sv * sr[i]
        if clip:
            m_hat = _clip(m_hat, min(ku, kc * sr[i]))
        p[i] = p[i] * decay + (neg_step * m_hat) / (d + eps)


@njit(nogil=True, error_model="numpy", cache=True)
def _colsum_sq(g, block, acc):
    """acc[j] = sum over the blocks of g (a whole number of them) of g[b, j]**2."""
    for j in range(block):
        acc[j] = np.float32(0.0)
    _colsum_sq_into(g, block, acc)


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _colsum_sq_into(g, block, acc):
    """``_colsum_sq`` added into ``acc`` (not cleared)."""
    for b in range(g.size // block):
        gb = g[b * block:(b + 1) * block]
        for j in range(block):
            acc[j] += gb[j] * gb[j]


@njit(nogil=True, error_model="numpy", cache=True)
def _factor_reduce(meta, jobs, wptrs, seeds, block, beta2, one_minus_beta2, partial, ratio):
    total = np.zeros((meta.shape[0], block), dtype=np.float32)
    for k in range(jobs.shape[0]):
        t = jobs[k, 0]
        for j in range(block):
            total[t, j] += partial[k, j]
    half = seeds.shape[0] > 0
    for t in range(meta.shape[0]):
        nb = np.float32(meta[t, NUMEL] // block)
        if half:  # bf16 w: updated in fp32 in total's row, stored rounded stochastically, read back
            w = total[t]
            w16 = carray(_typed_ptr(np.uint16, wptrs[t]), (block,))
            bits = w.view(np.uint32)
            for j in range(block):
                g2 = w[j]
                bits[j] = np.uint32(w16[j]) << np.uint32(16)  # the stored w, exactly
                new = beta2 * w[j] + one_minus_beta2 * (g2 / nb)
                if np.isfinite(new):  # a non-finite offset keeps its value (reference.factor_update)
                    w[j] = new
            round_bf16_stochastic(w, w16, seeds[t], 0)
            _widen_bf16(w16, w)
        else:
            w = carray(_typed_ptr(np.float32, wptrs[t]), (block,))
            for j in range(block):
                new = beta2 * w[j] + one_minus_beta2 * (total[t, j] / nb)
                if np.isfinite(new):  # a non-finite offset keeps its value (reference.factor_update)
                    w[j] = new
        s = np.float32(0.0)
        for j in range(block):
            s += w[j]
        mean = s / np.float32(block)
        for j in range(block):
            ratio[t, j] = np.sqrt(w[j] / mean) if mean > np.float32(0.0) else np.float32(1.0)
        ratio[t, block] = np.sqrt(nb * mean)  # times sqrt(r_j): sqrt(n_b w_j), the clip's column cap


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _widen_bf16(src, out):
    """bf16 bit patterns ``src`` as fp32 into ``out`` (exact: the pattern shifted 16 bits up)."""
    bits = out.view(np.uint32)
    for i in range(src.size):
        bits[i] = np.uint32(src[i]) << np.uint32(16)


@njit(nogil=True, error_model="numpy", cache=True)
def _factor_job(meta, jobs, k, block, S, partial):
    t = jobs[k, 0]
    n = meta[t, NUMEL]
    lo, hi = jobs[k, 1] * S, min(jobs[k, 2] * S, n)
    acc = carray(_alloca(np.float32, _LANES), (_LANES,))
    if meta[t, G_BF16] == 0:
        gk = carray(_typed_ptr(np.float32, meta[t, G_ADDR]), (n,))[lo:hi]
        if block == 1:  # one column: the lane sum (a single accumulator would be latency-bound)
            partial[k, 0] = _sum_sq(gk, acc)
        else:
            _colsum_sq(gk, block, partial[k])
        return
    # bf16: widened a chunk at a time, chunks of whole lane rows or blocks, so that every sum is
    # added in the order of the fp32 path
    src = carray(_typed_ptr(np.uint16, meta[t, G_ADDR]), (n,))
    unit = _LANES if block == 1 else block
    chunk = max(1, MAX_S // unit) * unit
    buf = carray(_alloca(np.float32, _BUF), (_BUF,))
    if block == 1:
        for q in range(_LANES):
            acc[q] = np.float32(0.0)
    else:
        for j in range(block):
            partial[k, j] = np.float32(0.0)
    for a in range(lo, hi, chunk):
        b = min(a + chunk, hi)
        _widen_bf16(src[a:b], buf)
        if block == 1:
            _sum_sq_into(buf[:b - a], acc)
        else:
            _colsum_sq_into(buf[:b - a], block, partial[k])
    if block == 1:
        partial[k, 0] = _fold(acc)


@njit(nogil=True, error_model="numpy", parallel=True, cache=True)
def _factor_parallel(meta, jobs, wptrs, seeds, block, S, beta2, one_minus_beta2, partial, ratio):
    for k in prange(jobs.shape[0]):
        _factor_job(meta, jobs, k, block, S, partial)
    _factor_reduce(meta, jobs, wptrs, seeds, block, beta2, one_minus_beta2, partial, ratio)


@njit(nogil=True, error_model="numpy", cache=True)
def _factor_serial(meta, jobs, wptrs, seeds, block, S, beta2, one_minus_beta2, partial, ratio):
    for k in range(jobs.shape[0]):
        _factor_job(meta, jobs, k, block, S, partial)
    _factor_reduce(meta, jobs, wptrs, seeds, block, beta2, one_minus_beta2, partial, ratio)


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _decode_simd(bits4, per_element, codes, start, stop, tabs, s, p, g_addr, g_ahead, g_shift, v, w1, m, c, acc):
    """AVX-512: m = lerp(C[code] * s, g, w1) for elements start..stop-1 (into m from 0); returns
    max |m| as int32 bits, and sum(g**2) in the 64 lane sums ``acc``. Groups of ``_GROUP``, the
    last under ``_GROUP`` elements in groups of 64 (masked: nothing past the block is read). The
    fp32 g of element i is at ``g_addr + 4 i``; the stored g (prefetched ahead) at ``g_ahead``, in
    elements of ``1 << g_shift`` bytes."""
    L = stop - start
    small = abs(w1) < 0.5
    w = w1 if small else w1 - np.float32(1.0)
    if bits4:
        _unpack4(codes, start, stop, c)
    for k in range(_LANES):
        acc[k] = np.float32(0.0)
    a = np.int32(0)
    k = 0
    while k < L:
        ahead = start + k + _AHEAD_ELEMENTS  # a few lines a group: a burst of prefetches would be dropped
        _prefetch8(g_ahead + (ahead << g_shift))
        _prefetch8(_data(p) + 4 * ahead)
        if per_element:
            _prefetch8(_data(v) + 4 * ahead)
        _prefetch(_data(codes) + (ahead >> 1 if bits4 else ahead))
        _prefetch(_data(codes) + (ahead >> 1 if bits4 else ahead) + 64)
        src = _data(c) + k if bits4 else _data(codes) + start + k
        gs, dst = g_addr + 4 * (start + k), _data(m) + 4 * k
        if L - k >= _GROUP and bits4:
            a = max(a, _vdecode4(_GROUP, src, _data(tabs), s, gs, w, small, _GROUP, dst, _data(acc)))
        elif L - k >= _GROUP:
            a = max(a, _vdecode8(_GROUP, src, _data(tabs), s, gs, w, small, _GROUP, dst, _data(acc)))
        elif bits4:
            a = max(a, _vdecode4(64, src, _data(tabs), s, gs, w, small, min(64, L - k), dst, _data(acc)))
        else:
            a = max(a, _vdecode8(64, src, _data(tabs), s, gs, w, small, min(64, L - k), dst, _data(acc)))
        k += _GROUP if L - k >= _GROUP else 64
    return a


@njit(nogil=True, error_model="numpy", cache=True, inline="always")
def _quantize_simd(bits4, codes, start, stop, amax, tabs, lut8, lut_scale, m, u, c, value):
    """AVX-512: the codes of q = m / amax into ``codes`` (elements start..stop-1; ``m`` from 0) and
    their entries into ``value``, in the groups of ``_decode_simd``."""
    L = stop - start
    div = amax if amax > np.float32(0.0) else np.float32(1.0)  # NaN: 1, as _bins
    if not bits4 and lut8.size != 1024:  # a table of more bins (entries closer than 2^-9): scalar lookups
        _bins(m, L, amax, lut_scale, np.uint32(lut8.size - 1), u)
        for i in range(L):
            c[i] = lut8[u[i]]
    k = 0
    while k < L:
        q, cs, vs = _data(m) + 4 * k, _data(codes) + start + k, _data(value) + 4 * k
        n = min(_GROUP if L - k >= _GROUP else 64, L - k)
        if bits4 and L - k >= _GROUP:
            _vquantize4(_GROUP, q, div, _data(tabs), _data(c) + k, vs)
        elif bits4:
            _vquantize4(64, q, div, _data(tabs), _data(c) + k, vs)
        elif lut8.size == 1024 and L - k >= _GROUP:
            _vquantize8(_GROUP, q, div, lut_scale, _data(lut8), _data(tabs), cs, vs, n)
        elif lut8.size == 1024:
            _vquantize8(64, q, div, lut_scale, _data(lut8), _data(tabs), cs, vs, n)
        elif L - k >= _GROUP:
            _vchoose8(_GROUP, q, _data(c) + k, _data(tabs), cs, vs, n)
        else:
            _vchoose8(64, q, _data(c) + k, _data(tabs), cs, vs, n)
        k += _GROUP if L - k >= _GROUP else 64
    if bits4:
        _pack4(c, start, stop, codes)


@njit(nogil=True, error_model="numpy", cache=True)
def _blocks(bits4, per_element, factored, quant, p, g, g16, v, scales, codes, m_fp32, r, j0, j1, cb, lut, tabs,
            lut8, lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, kb, m, u, value, c,
            wide):
    """Scale blocks j0..j1-1 of one tensor, pass by pass (see the module docstring). ``m_fp32``: the
    unquantised first moment (``quant`` False; codes and scales are then empty). The gradient is
    ``g`` (fp32), or where ``g16`` (bf16 bit patterns) is not empty ``g16``, each block widened into
    ``wide`` first. ``m``, ``u``, ``value``, ``c``, ``wide``: scratch of S + ``_PAD`` elements or
    more."""
    n = p.size
    tabs16 = tabs[_CB16:_TABS].view(np.float32)
    acc = carray(_alloca(np.float32, _LANES), (_LANES,))
    table = carray(_alloca(np.float32, _TABLE), (_TABLE,))
    if not _SIMD:
        for k in range(_TABLE):
            table[k] = np.float32(0.0)
        for k in range(min(cb.size, _TABLE)):
            table[k] = cb[k]
    top = np.uint32(lut.size - 1)
    # tuples: registers in _quantize4 (portable 4-bit path; 16 entries even where unused)
    bounds16 = (tabs16[16], tabs16[17], tabs16[18], tabs16[19], tabs16[20], tabs16[21], tabs16[22], tabs16[23],
                tabs16[24], tabs16[25], tabs16[26], tabs16[27], tabs16[28], tabs16[29], tabs16[30], tabs16[31])
    cb16 = (tabs16[0], tabs16[1], tabs16[2], tabs16[3], tabs16[4], tabs16[5], tabs16[6], tabs16[7], tabs16[8],
            tabs16[9], tabs16[10], tabs16[11], tabs16[12], tabs16[13], tabs16[14], tabs16[15])
    half = g16.size > 0
    g_ahead, g_shift = (_data(g16), 1) if half else (_data(g), 2)
    # the clip's caps (reference.own_moment_cap): sqrt(P v_b) = sqrt(P) sqrt(v_b), and under the factor
    # sqrt(n_b w_j) = sqrt(n_b mean(w)) sqrt(r_j), the first factor after the row of sqrt(r_j)
    root_p = np.float32(np.sqrt(np.float32(block)))
    kc = kb * (r[block] / bc2_sqrt) if factored else np.float32(0.0)
    for j in range(j0, j1):
        start = j * S
        stop = min(start + S, n)
        L = stop - start
        if half:
            _widen_bf16(g16[start:stop], wide)
            gj = wide[:L]
            g_addr = _data(wide) - 4 * start  # element i of the block at g_addr + 4 i, as for fp32 g
        else:
            gj = g[start:stop]
            g_addr = _data(g)
        summed = False  # the AVX-512 decode sums g**2 into acc on its way
        if j + _AHEAD < j1 and not (_SIMD and quant):
            _prefetch_block(p, g_ahead, g_shift, codes, bits4, quant, start + _AHEAD * S,
                            min(start + (_AHEAD + 1) * S, n))
        if not quant:  # m^ is the stored m after the lerp (times 1: exact)
            mj = m_fp32[start:stop]
            _lerp_fp32(gj, w1, mj)
            amax = np.float32(1.0)
        elif _SIMD:
            amax = _bits_f32(_decode_simd(bits4, per_element, codes, start, stop, tabs, scales[j], p, g_addr, g_ahead,
                                          g_shift, v, w1, m, c, acc))
            summed = True
            scales[j] = amax
            _quantize_simd(bits4, codes, start, stop, amax, tabs, lut8, lut_scale, m, u, c, value)
            mj = value[:L]
        else:
            mj = m[:L]
            if bits4:
                _unpack4(codes, start, stop, c)
                a = _decode_lerp(c[:L], table, scales[j], gj, w1, mj)
            else:
                a = _decode_lerp(codes[start:stop], table, scales[j], gj, w1, mj)
            amax = _bits_f32(a)
            scales[j] = amax
            if bits4:
                _quantize4(mj, L, amax, bounds16, cb16, c)
                _pack4(c, start, stop, codes)
            else:
                _bins(mj, L, amax, lut_scale, top, u)
                _lookup(codes[start:stop], mj, u, lut, table, value)
                mj = value[:L]
        if per_element:
            _v_update_per_element(p[start:stop], mj, amax, v[start:stop], gj, beta2, one_minus_beta2, decay,
                                  neg_step, bc2_sqrt, eps, kb)
        elif S == block:  # one v per scale block, one division per block
            vb = beta2 * v[j] + one_minus_beta2 * ((_bits_f32(_vsum(0, _data(acc))) if summed else _sum_sq(gj, acc))
                                                   / np.float32(block))
            v[j] = vb
            if factored:
                sv = np.float32(np.sqrt(vb) / bc2_sqrt)
                _update_factored(p[start:stop], mj, amax, sv, r, decay, neg_step, eps, kb, kb * root_p * sv, kc)
            else:
                d = np.float32(np.sqrt(vb) / bc2_sqrt)
                _update_shared(p[start:stop], mj, amax, decay, neg_step / (d + eps), kb * root_p * d)
        else:  # S a multiple of the block (row-group scales): each block inside it has its own v
            per = S // block
            for q in range(L // block):
                a = q * block
                vb = beta2 * v[j * per + q] + one_minus_beta2 * (_sum_sq(gj[a:a + block], acc) / np.float32(block))
                v[j * per + q] = vb
                if factored:
                    sv = np.float32(np.sqrt(vb) / bc2_sqrt)
                    _update_factored(p[start + a:start + a + block], mj[a:a + block], amax, sv, r, decay, neg_step,
                                     eps, kb, kb * root_p * sv, kc)
                else:
                    d = np.float32(np.sqrt(vb) / bc2_sqrt)
                    _update_shared(p[start + a:start + a + block], mj[a:a + block], amax, decay, neg_step / (d + eps),
                                   kb * root_p * d)


@njit(nogil=True, error_model="numpy", cache=True)
def _job(bits4, per_element, factored, quant, meta, jobs, k, ratio, cb, lut, tabs, lut8, lut_scale, block, S,
         w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, kb):
    t = jobs[k, 0]
    p = carray(_typed_ptr(np.float32, meta[t, P_ADDR]), (meta[t, NUMEL],))
    half = meta[t, G_BF16] != 0
    g = carray(_typed_ptr(np.float32, meta[t, G_ADDR]), (0 if half else meta[t, NUMEL],))
    g16 = carray(_typed_ptr(np.uint16, meta[t, G_ADDR]), (meta[t, NUMEL] if half else 0,))
    v = carray(_typed_ptr(np.float32, meta[t, V_ADDR]), (meta[t, V_NUMEL],))
    scales = carray(_typed_ptr(np.float32, meta[t, SCALES_ADDR]), (meta[t, SCALES_NUMEL] if quant else 0,))
    codes = carray(_typed_ptr(np.uint8, meta[t, CODES_ADDR]), (meta[t, CODES_NUMEL] if quant else 0,))
    m_fp32 = carray(_typed_ptr(np.float32, meta[t, M_ADDR]), (0 if quant else meta[t, NUMEL],))
    r = ratio[t if factored else 0]
    if S <= MAX_S:
        m = carray(_alloca(np.float32, _BUF), (_BUF,))
        u = carray(_alloca(np.uint16, _BUF), (_BUF,))
        value = carray(_alloca(np.float32, _BUF), (_BUF,))
        c = carray(_alloca(np.uint8, _BUF), (_BUF,))
        wide = carray(_alloca(np.float32, _BUF), (_BUF,))
        _blocks(bits4, per_element, factored, quant, p, g, g16, v, scales, codes, m_fp32, r, jobs[k, 1],
                jobs[k, 2], cb, lut, tabs, lut8, lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step,
                bc2_sqrt, eps, kb, m, u, value, c, wide)
    else:
        mh, uh = np.empty(S + _PAD, dtype=np.float32), np.empty(S + _PAD, dtype=np.uint16)
        vh, ch = np.empty(S + _PAD, dtype=np.float32), np.empty(S + _PAD, dtype=np.uint8)
        wh = np.empty(S + _PAD if half else 1, dtype=np.float32)
        _blocks(bits4, per_element, factored, quant, p, g, g16, v, scales, codes, m_fp32, r, jobs[k, 1],
                jobs[k, 2], cb, lut, tabs, lut8, lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step,
                bc2_sqrt, eps, kb, mh, uh, vh, ch, wh)


@njit(nogil=True, error_model="numpy", cache=True)
def _tables(quant, cb, bounds, lut_code, lut_bound):
    """The call's lookup tables: ``lut`` (portable path, 8 bits: boundary bits | code << 32 a bin),
    ``tabs`` (the codebook and the boundaries as 16 floats each; AVX-512 path: also as byte planes)
    and ``lut8`` (AVX-512 path: the code below each bin, a byte)."""
    lut = np.zeros(1, dtype=np.uint64)
    tabs = np.zeros(_TABS, dtype=np.uint8)
    lut8 = np.zeros(1, dtype=np.uint8)
    if not quant:
        return lut, tabs, lut8
    f = tabs[_CB16:_TABS].view(np.float32)
    f[:] = np.float32(np.inf)
    for e in range(min(cb.size, 16)):
        f[e] = cb[e]
    for e in range(min(bounds.size, 16)):
        f[16 + e] = bounds[e]
    if not _SIMD:
        return _pack_lut(lut_code, lut_bound), tabs, lut8
    cbb, bb = cb.view(np.uint8), bounds.view(np.uint8)
    inf = np.array([np.inf], dtype=np.float32).view(np.uint8)
    for e in range(256):
        for k in range(4):
            tabs[_CB_PLANES + 256 * k + e] = cbb[4 * e + k] if e < cb.size else 0
            tabs[_BOUND_PLANES + 256 * k + e] = bb[4 * e + k] if e < bounds.size else inf[k]
    lut8 = np.empty(lut_code.size, dtype=np.uint8)
    for i in range(lut8.size):
        lut8[i] = np.uint8(lut_code[i])
    return lut, tabs, lut8


@njit(nogil=True, error_model="numpy", parallel=True, cache=True)
def _step_parallel(bits4, per_element, factored, quant, meta, jobs, ratio, cb, bounds, lut_code, lut_bound,
                   lut_values, lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, kb):
    lut, tabs, lut8 = _tables(quant, cb, bounds, lut_code, lut_bound)
    for k in prange(jobs.shape[0]):
        _job(bits4, per_element, factored, quant, meta, jobs, k, ratio, cb, lut, tabs, lut8, lut_scale, block,
             S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, kb)


@njit(nogil=True, error_model="numpy", cache=True)
def _step_serial(bits4, per_element, factored, quant, meta, jobs, ratio, cb, bounds, lut_code, lut_bound,
                 lut_values, lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, kb):
    # the same passes compiled again: every pass is written so that its rounding cannot depend on
    # the copy (no multiply-add with two products to choose from, no reassoc)
    lut, tabs, lut8 = _tables(quant, cb, bounds, lut_code, lut_bound)
    for k in range(jobs.shape[0]):
        _job(bits4, per_element, factored, quant, meta, jobs, k, ratio, cb, lut, tabs, lut8, lut_scale, block,
             S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, kb)


# ------------------------------------------------------------------------- stochastic rounding
_MASK32 = np.uint64(0xFFFFFFFF)


@njit(nogil=True, error_model="numpy", cache=True)
def _hash32(x):
    """``optim._rounding.hash32`` on a uint64 holding 32 bits (numba widens uint32 products)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & _MASK32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _MASK32
    return x ^ (x >> np.uint64(16))


@njit(nogil=True, error_model="numpy", cache=True)
def round_bf16_stochastic(x, out, seed, offset):
    """fp32 ``x`` rounded stochastically into ``out`` (uint16 bf16 bit patterns): the random word of
    element i is ``hash32(((offset + i) * GOLDEN + seed) mod 2**32)`` and its low 16 bits are added
    to x's pattern before truncation; non-finite x, or a result that would round to an infinity,
    round to nearest (``optim._rounding.round_stochastic``, bit for bit)."""
    bits = x.view(np.uint32)
    s = np.uint64(seed) & _MASK32
    for i in range(x.size):
        k = np.uint64(offset + i) & _MASK32
        h = _hash32((((k * np.uint64(0x9E3779B9)) & _MASK32) + s) & _MASK32)
        b = np.uint64(bits[i])
        exp_all_ones = (b & np.uint64(0x7F800000)) == np.uint64(0x7F800000)
        up = ((b + (h & np.uint64(0xFFFF))) & _MASK32) >> np.uint64(16)
        if exp_all_ones or (up & np.uint64(0x7F80)) == np.uint64(0x7F80):
            # round to nearest, ties to even (NaN stays NaN: its pattern keeps a set mantissa bit)
            if exp_all_ones and (b & np.uint64(0x7FFFFF)) != np.uint64(0):
                up = (b >> np.uint64(16)) | np.uint64(0x40)
            else:
                up = ((b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & np.uint64(1))) & _MASK32) >> np.uint64(16)
        out[i] = np.uint16(up)


