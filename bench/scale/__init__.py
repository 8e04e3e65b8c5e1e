"""The scaling lab: N ranks on shaped hosts with synthetic models (``python -m bench.scale``; worker.py is one
rank, probe.py measures the links, table.py and plot.py report), the reducer's CPU per step against torch's
(``python -m bench.scale.step_cpu``), and the planner on the DDP paper's setting (``python -m bench.scale.paper_plan``).
"""
