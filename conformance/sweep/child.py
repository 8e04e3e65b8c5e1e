"""``python -m conformance.sweep.child NAME OUT.json``: run one case in this fresh process and write its classification.

The parent (``python -m conformance.sweep``) kills this process if it outlives the case's hard timeout (a hang) and
reports a crash if it dies without writing OUT.json.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    name, out = argv
    import os

    from conformance.sweep.cases import by_name
    from conformance.sweep.core import classify
    from conformance.sweep.zygote import use_scratch

    use_scratch(os.path.dirname(os.path.abspath(out)))

    c = by_name()[name]
    start = time.monotonic()
    result = classify(c, c.run)
    result["seconds"] = round(time.monotonic() - start, 2)
    with open(out, "w") as fh:
        json.dump(result, fh)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Skip interpreter teardown: a case may leave a process group or gloo threads behind, and their destruction at
    # exit is not what this case measures (the result is already written).
    import os

    os._exit(code)
