"""The lab plumbing that bench/, conformance/ and tests/ share; it imports only gradsync, and gradsync never imports it.

netlab.py        hosts as network namespaces on a bridge, each link shaped by tc (needs root)
ranks.py         wait for a lab's rank processes, all within one deadline
etcd_cluster.py  etcd members on loopback or on netlab hosts
elastic.py       the elastic fault lab: a ``gradsync run --elastic`` job on 3 hosts, faults injected, checks
results.py       write_json: every result file with its command line and commit
zoo/             the one model zoo: workloads (benchmarks), toys (correctness), synthetic (the scaling lab)
"""
