import sys
from pathlib import Path

# The GPU check shares the suite's models and data (lab/zoo/toys.py, tests/ddp_cases.py).
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
