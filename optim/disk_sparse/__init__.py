"""Disk Sparse Adam: Adam for sparse embedding tables with moments in memory-mapped files."""
