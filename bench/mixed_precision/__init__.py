"""The mixed-precision bench: mixed_precision= against autocast and fp32 (``python -m bench.mixed_precision``)."""
