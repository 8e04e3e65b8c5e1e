"""Bad inputs and faults against gradsync, each classified automatically (issue 20).

    python -m conformance.sweep                      # every case, results in conformance/results/sweep.json
    python -m conformance.sweep -k checkpoint        # cases whose name or category contains "checkpoint"
    python -m conformance.sweep --list               # what would run

Each case runs in a fresh Python process (``python -m conformance.sweep.child NAME``) under a hard timeout, so a
case that hangs or kills its interpreter cannot take the sweep with it. The classes:

- ``clear``: an error whose text has every expected keyword (it names the input or operation at fault and says
  what to do), of a type that is not a bare internal one (AssertionError, KeyError, ...);
- ``accepted``: a valid but unusual input, accepted, and the case's check of the result passes;
- ``vague``: an error whose text lacks an expected keyword (a raw backend error, a bare AssertionError, a
  traceback where one line was due, a valid input refused);
- ``silently wrong``: no error, but the result is wrong (or no error where one was due and nothing is checked);
- ``hang``: something still ran at the case's hard timeout (and was killed);
- ``crash``: a process died from a signal or without a Python exception;
- ``skipped``: the case cannot run on this machine (the reason is given).

Multi-rank cases use :func:`gradsync.testing.spawn` (2 gloo ranks); launcher cases run ``python -m gradsync ...``.
The cases live in ``conformance/sweep/cases/``, one module per category.

Beside these hand-written cases, ``python -m conformance.sweep.generated`` runs the sweep generated from the
surface (conformance/sweep/generated/): every public parameter, flag, ``--rdzv-conf`` key, ``GRADSYNC_*`` variable
and restored state, with wrong values derived from each one's valid domain; its results are
``conformance/results/sweep-generated.json`` (and ``sweep-generated-before.json``: the branch point of issue 58).
"""
