"""Run one test of ``DistributedTest._DistTestBase`` with unittest and write its outcome as JSON.

``python -m conformance.torch_suite.run_one TEST_NAME RESULT_JSON``: the runner starts this in a fresh process (its own
session, killed as a group on timeout) with the environment of :func:`conformance.torch_suite.runner.test_env`.
The outcome file holds ``{"status": "passed" | "failed" | "skipped", "message": str}``.
"""

from __future__ import annotations

import io
import json
import sys
import unittest
from pathlib import Path


def run(test_name: str) -> dict[str, str]:
    from conformance.torch_suite.harness import TestDistBackendWithSpawn

    stream = io.StringIO()
    suite = unittest.TestSuite([TestDistBackendWithSpawn(test_name)])
    result = unittest.TextTestRunner(stream=stream, verbosity=2).run(suite)
    sys.stderr.write(stream.getvalue())
    for _test, reason in result.skipped:
        return {"status": "skipped", "message": str(reason)}
    for _test, trace in [*result.errors, *result.failures]:
        return {"status": "failed", "message": str(trace)}
    if result.unexpectedSuccesses:
        return {"status": "failed", "message": "unexpected success of an expected failure"}
    if result.testsRun == 0:
        return {"status": "failed", "message": "unittest ran nothing"}
    return {"status": "passed", "message": ""}


def main(argv: list[str]) -> int:
    test_name, out = argv
    outcome = run(test_name)
    Path(out).write_text(json.dumps(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
