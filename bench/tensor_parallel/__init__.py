"""DP x TP side by side: torch's DDP and gradsync's over the same tensor-parallel model on a ("dp", "tp") mesh, two
hosts of two ranks each (tp inside a host, dp across the shaped link). ``python -m bench.tensor_parallel``."""
