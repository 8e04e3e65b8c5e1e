"""Where the time goes: step breakdown, bucket timeline (Chrome trace), straggler view, report."""

from gradsync.observe.breakdown import StepBreakdown, arrivals, median_breakdown, slowest_rank
from gradsync.observe.monitor import Monitor
from gradsync.observe.trace import chrome_trace, read_steps, write_chrome_trace

__all__ = [
    "Monitor",
    "StepBreakdown",
    "arrivals",
    "chrome_trace",
    "median_breakdown",
    "read_steps",
    "slowest_rank",
    "write_chrome_trace",
]
