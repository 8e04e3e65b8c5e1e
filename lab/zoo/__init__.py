"""The one model zoo, for benchmarks, conformance suites and tests alike.

workloads.py   the benchmark models: a residual MLP, a GPT-style decoder, a CNN with BatchNorm, ~1,000 tiny
               parameters (``make(name)``: the model and its batches)
toys.py        small models that each stress one thing the reducer must get right, built from a seed
               (``build(name)``), and the bad-input sweep's models
synthetic.py   real models' parameter shapes (ResNet-50, BERT, GPT-2) with prescribed compute per layer
"""
