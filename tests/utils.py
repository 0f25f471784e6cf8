"""Tolerance helpers used by every test: one place, one message format."""

import torch


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||a - e|| / max(||e||, tiny), computed in float64."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def assert_close(actual, expected, *, atol=0.0, rtol=0.0, rel_rms_tol=None, name="tensor"):
    """Fail if any |a - e| > atol + rtol*|e| (or the relative RMS error exceeds rel_rms_tol).

    The failure message carries the max-abs error, the relative RMS error and the first mismatching
    indices with their values, so a failing CI log is enough to start debugging.
    """
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    diff = (a - e).abs()
    nan_mismatch = a.isnan() != e.isnan()
    bad = (diff > atol + rtol * e.abs()) | nan_mismatch
    bad &= ~(a.isnan() & e.isnan())
    rr = rel_rms(a.nan_to_num(), e.nan_to_num())
    msgs = []
    if bad.any():
        idx = bad.nonzero()[:5]
        first = ", ".join(f"{tuple(i.tolist())}: {a[tuple(i)].item():.10g} vs {e[tuple(i)].item():.10g}" for i in idx)
        msgs.append(f"{int(bad.sum())}/{bad.numel()} elements exceed atol={atol:g} rtol={rtol:g}; first: {first}")
    if rel_rms_tol is not None and rr > rel_rms_tol:
        msgs.append(f"relative RMS error {rr:.3e} > {rel_rms_tol:g}")
    if msgs:
        maxabs = float(diff.nan_to_num().max()) if diff.numel() else 0.0
        raise AssertionError(f"{name}: max|Δ|={maxabs:.3e}, rel RMS={rr:.3e}; " + "; ".join(msgs))
