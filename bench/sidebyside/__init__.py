"""The side-by-side lab: torch's DDP and gradsync variants in the same two processes, one step of each in turn.

``python -m bench`` runs it once (runner.py; each rank is worker.py, building the variants of variants.py on a model
of lab/zoo/workloads.py), ``python -m bench.sidebyside.repeat`` several times for medians over runs; plot.py draws
a run's step breakdown and ``python -m bench.sidebyside.markdown`` prints runs as README tables.
"""
