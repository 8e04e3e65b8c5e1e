"""``gradsync doctor``: will a job with these launch flags work on this machine? Each check is a small function
that returns a :class:`~gradsync.doctor.result.Result` (ok, warn, fail or skip, what it found and what to do);
:mod:`.report` runs them and prints a table, or JSON.

``torch_checks.py``  Python, gradsync's own version, torch against the supported floor, torch's private names
``backends.py``      gloo; NCCL and the GPUs it would use
``network.py``       the interface gloo will pick, and whether other hosts can reach it
``store.py``         whether the rendezvous endpoint or the etcd members answer
``kernel.py``        the lab's kernel features (namespaces, veth, tc's tbf and netem); lab/netlab.py probes with it
``job.py``           the flags of ``gradsync run`` that the checks read, parsed and refused by gradsync run's own
                     rules (gradsync/runtime/run_flags.py)
``report.py``        the command: every check, a table or JSON, the exit status

It sits at the top with the command: nothing in the library imports it, and it imports no launcher.
"""
