"""The bad-input sweep generated from the surface (issue 58), beside the hand-written one (conformance/sweep/cases/).

Where the hand-written sweep has one function per case, this one has one table entry per public parameter, flag,
``--rdzv-conf`` key, variable and restored object, and generates the wrong values from each entry's valid domain:

- surface.py   what is public, read from the code (``__all__``, the parsers, the source's ``GRADSYNC_*`` names);
- values.py    domains, and the wrong values derived from them;
- api.py, restore.py, commands.py   the tables: a valid baseline call and each parameter's domain;
- generate.py  the cases; runner.py: one forked child per case, classified (clear, vague, silently accepted, hang,
  crash; accepted for a valid baseline).

``python -m conformance.sweep.generated`` runs every case (about a minute of CPU); tests/test_generated_sweep.py
checks that every public name, flag and variable has a table entry, and runs a fast subset.
"""
