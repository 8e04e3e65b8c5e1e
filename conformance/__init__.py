"""Conformance suites: gradsync held to torch's own DDP tests and to bad input, each a runner with its own results.

    python -m conformance.torch_suite --ddp both --start-method fork   # torch's DDP tests, torch's and gradsync's DDP
    python -m conformance.sweep                                        # bad inputs and faults, each classified

Results in conformance/results/. They import gradsync and lab/ (the shared zoo and result writer), never bench/.
"""
