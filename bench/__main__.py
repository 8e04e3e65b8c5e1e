"""``python -m bench``: the side-by-side benchmark (bench/sidebyside/runner.py; ``--help`` for its flags)."""

import sys

from bench.sidebyside.runner import main

sys.exit(main())
