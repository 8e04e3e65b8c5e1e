"""The job's store: which one a job uses (torch's TCPStore, or etcd with ``--store etcd://``), and etcd's as a torch
``Store`` with its client. Shared by the elastic workers, their launchers and ``gradsync doctor``; it knows nothing
of elastic training.

The folder: ``job_store.py`` (which store, and when it counts as lost), ``etcd_store.py`` (torch's Store on etcd),
``etcd_client.py`` (its client: failover, TLS, token), ``etcd_refusal.py`` (what a refusal means),
``etcd_watch.py`` (waiting for a key with a watch, not a poll).
"""
