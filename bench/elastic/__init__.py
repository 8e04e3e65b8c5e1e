"""The elastic labs, on lab/elastic.py's fault lab: ``python -m bench.elastic.recovery`` (pauses after a lost
worker or host) and ``python -m bench.elastic.overhead`` (what the elastic commit costs per step)."""
