"""Speculative decoding: draft models, the draft KV region, verification (see decoder.py)."""
