"""The values torchrun's text flags take, checked when ``gradsync run`` / ``gradsync doctor`` parse them.

torchrun declares these flags ``type=str`` and reads them later: an unknown ``--rdzv-backend`` or
``--logs-specs`` is a ValueError from deep in torch elastic once workers are being started, a bad ``--redirects``
one from ``Std.from_str``, and an unknown ``--signals-to-handle`` or ``--event-log-handler`` name, a negative
``--local-ranks-filter`` or an empty ``--local-addr`` is taken and never acted on. Here each kind of value has one
parser (:class:`Checked`), and :data:`KINDS` says which kind each flag is; :func:`gradsync.runtime.run_flags.parser`
installs them as the flags' ``type``, so a wrong value is refused in one line that names the flag, shows the value
and says what is valid (gradsync/cli.py: exit 2). ``PET_*`` defaults go through the same parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
from collections.abc import Callable
from importlib import metadata
from typing import Any

from torch.distributed.elastic.multiprocessing import Std

# torch's own rendezvous backends (torch/distributed/elastic/rendezvous/registry.py) and its event log handlers
# (torch/distributed/elastic/events/handlers.py); a plugin's come from its entry points, as torch finds them.
RENDEZVOUS_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
EVENT_LOG_HANDLERS = ("console", "dynamic_rendezvous", "null")
_RANKS = re.compile(r"^\d+(,\d+)*$")


@dataclasses.dataclass(frozen=True)
class Checked:
    """A flag's parser: ``text`` if ``valid(text)``, else argparse's error, which the parser turns into gradsync's
    one line (``--flag: 'text': give ...``). ``what``: what to give, said in the error; ``convert``: the value the
    flag holds (an int flag's int)."""

    valid: Callable[[str], bool]
    what: str
    convert: Callable[[str], Any] = str

    def __call__(self, text: str) -> Any:
        if not self.valid(text):
            raise argparse.ArgumentTypeError(f"{text!r}: give {self.what}.")
        return self.convert(text)


def _entry_points(group: str) -> tuple[str, ...]:
    return tuple(sorted(ep.name for ep in metadata.entry_points().select(group=group)))


def _one_of(names: tuple[str, ...], what: str) -> Checked:
    return Checked(lambda text: text in names, f"{what}: one of {', '.join(names) or '(none installed)'}")


def _whole(low: int, high: int | None = None) -> Checked:
    def valid(text: str) -> bool:
        return text.strip().isdigit() and low <= int(text) <= (high if high is not None else int(text))

    return Checked(valid, f"a whole number >= {low}" + (f" and <= {high}" if high is not None else ""), int)


def _std(text: str) -> bool:
    try:
        Std.from_str(text)  # torch's own reading of --redirects/--tee, which raises only once workers start
    except ValueError:
        return False
    return True


def _signals(text: str) -> bool:
    return all(name.strip() in signal.Signals.__members__ for name in text.split(","))


def _not_a_file(text: str) -> bool:
    return bool(text.strip()) and (os.path.isdir(text) or not os.path.exists(text))


def kinds() -> dict[str, Checked]:
    """flag (its dest) -> its parser. Read when a parser is built: a plugin's entry points are the installed ones."""
    count = _whole(0)  # --max-restarts' own rule is run_flags.check's (it says what the count is)
    return {
        "rdzv_backend": _one_of(RENDEZVOUS_BACKENDS + _entry_points("torchrun.handlers"), "a rendezvous backend"),
        "event_log_handler": _one_of(EVENT_LOG_HANDLERS, "torch elastic's event log handler"),
        "logs_specs": _one_of(_entry_points("torchrun.logs_specs"), "a torchrun.logs_specs entry point's name"),
        "redirects": Checked(_std, "0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank: 0:3,1:0"),
        "tee": Checked(_std, "0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank: 0:3,1:0"),
        "local_ranks_filter": Checked(lambda t: t == "" or bool(_RANKS.match(t)), "local ranks >= 0, e.g. 0,1,2"),
        "signals_to_handle": Checked(_signals, "signal names separated by commas, e.g. SIGTERM,SIGINT"),
        "local_addr": Checked(lambda t: bool(t.strip()), "this node's address (a host name or IP)"),
        "log_dir": Checked(_not_a_file, "a directory (or a path where one can be made), not a file"),
        "node_rank": count,
        "shutdown_timeout": Checked(count.valid, "a whole number of seconds >= 0", int),
        "master_port": _whole(0, 65535),
    }
