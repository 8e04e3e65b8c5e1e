"""The padding lab: how much padding LengthGroupedSampler saves on real text, against random batches
(``python -m bench.padding``)."""
