"""Names of the Disk Sparse optimizers' state, in one place (state dicts, rules and tests use these).

Per parameter (``optimizer.state[p]`` and ``state_dict()["state"]``), the same keys as
``torch.optim.SparseAdam``'s, so its checkpoints load here and back::

    STEP           int, steps with a gradient for this parameter (t of the bias corrections)
    EXP_AVG        the first moment, of the table's shape              (exact format)
    EXP_AVG_SQ     the second moment: of the table's shape (Adam), (N, 1) for the ball and for the
                   compact format (one per row)

and in the compact format (``compact.py``) the first moment as codes::

    EXP_AVG_SCALE  float32 (N, 1), the scale of a row's codes (max |m| of the row)
    EXP_AVG_CODES  int8 (N, D), m = code * scale / 127

``FORMAT_KEYS`` lists the moment keys each state format keeps, in record order.
"""

STEP = "step"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
EXP_AVG_SCALE = "exp_avg_scale"
EXP_AVG_CODES = "exp_avg_codes"

FORMAT_KEYS = {"exact": (EXP_AVG, EXP_AVG_SQ), "compact": (EXP_AVG_SCALE, EXP_AVG_SQ, EXP_AVG_CODES)}
