"""Thread count of the compiled (numba) CPU kernels: torch's, so one knob sets both."""

import torch


def numba_threads() -> int:
    """Numba threads for a kernel launch: ``torch.get_num_threads()`` (at most numba's); 1 means run
    the serial kernel.

    At one thread numba's OpenMP pool is never started. Starting it sets the OpenMP thread count of
    the process (numba and torch share libgomp) to ``NUMBA_NUM_THREADS``, so torch would silently
    run every later op on all cores after ``torch.set_num_threads(k)``; torch's count is put back
    if that happens.
    """
    threads = torch.get_num_threads()
    if threads <= 1:
        return 1
    import numba

    n = min(threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return n
