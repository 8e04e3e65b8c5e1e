"""The job's store under 256 and 1,024 ranks, measured: ``python -m bench.store_load`` (docs/scaling.md).

``recording.py`` wraps a store and writes down every operation (the real job's and the simulated ranks' alike);
``record_worker.py`` is a real elastic rank whose requests are recorded; ``sim.py`` runs many simulated ranks,
each the library's own ``Membership`` on its own clients, so the simulation is the code; ``pattern.py`` reduces a
record to a rank's requests per heartbeat, by operation, which the benchmark compares between the real and the
simulated ranks before it reports a figure; ``servers.py`` starts the stores.
"""
