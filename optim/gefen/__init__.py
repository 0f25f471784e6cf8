"""Gefen: AdamW with about one byte of state per parameter (arXiv 2606.13894)."""
