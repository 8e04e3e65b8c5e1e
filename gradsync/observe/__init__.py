"""Where the time goes: the ``Monitor`` and the step recorder it attaches to a model, each step split into forward,
backward compute and exposed communication, the slowest rank, the bucket timeline as a Chrome trace, the table and
report of ``gradsync report``, and the clock that times work on its device."""

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
