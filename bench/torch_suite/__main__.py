"""Entry point: ``python -m bench.torch_suite --help``."""

import sys

from bench.torch_suite.cli import main

sys.exit(main())
