import sys
from pathlib import Path

# The GPU check shares the suite's models and data (tests/models.py, tests/ddp_cases.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
