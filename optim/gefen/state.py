"""Names of Gefen's optimizer state, in one place (state dicts, kernels and tests use these).

Per parameter (``optimizer.state[p]``; layout and shapes in ``reference.py``'s docstring)::

    STEP    int, updates applied to this parameter (t of the bias corrections)
    BLOCK   int, block length P of the shared second moment, fixed at the first gradient
    V       fp32 (numel // P,), block-shared second moment
    SCALES  fp32 (ceil(numel / S),), first-moment scale per scale block (quantised groups)
    CODES   uint8 (numel,) at 8 bits, (ceil(numel / 2),) at 4 bits (quantised groups)
    M       fp32 (numel,), the unquantised first moment (groups with quantize_first_moment=False)
    W       fp32 (tiles * P,), per-offset factor of the second moment, one P-vector a tile of rows
            (``partition.factor_tiles``; groups with factor_second_moment=True)
    PROVISIONAL  bool, present (True) while every gradient so far had one magnitude everywhere: any
            block length is then exact, BLOCK is the cheapest, and it is chosen again from the
            first gradient that varies (``Gefen._recut``)
    SEED    int, the seed of stochastic rounding (groups with stochastic_rounding=True): a hash of
            the optimizer's ROUNDING_SEED and the parameter's index

Optimizer-wide (top-level keys of ``Gefen.state_dict()``)::

    CODEBOOK  fp32 (2**bits,) sorted, or None before the first step
    BITS      int, 8 or 4
    ROUNDING_SEED  int, the optimizer's stochastic-rounding seed (from ``torch.initial_seed()``,
            broadcast from rank 0 under torch.distributed), or None before a group rounds
"""

STEP = "step"
BLOCK = "block"
V = "v"
SCALES = "scales"
CODES = "codes"
M = "m"
W = "w"
SEED = "seed"
PROVISIONAL = "provisional"

CODEBOOK = "codebook"
BITS = "bits"
ROUNDING_SEED = "rounding_seed"

PER_PARAM_TENSORS = (V, SCALES, CODES, M, W)
