"""The two-level all-reduce against torch's flat one, hosts of several ranks: ``python -m bench.hierarchical``."""
