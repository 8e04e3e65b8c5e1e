"""Entry point: ``python -m conformance.torch_suite --help``."""

import sys

from conformance.torch_suite.cli import main

sys.exit(main())
