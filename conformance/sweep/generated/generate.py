"""Every generated case: for each entry of the surface (surface.py), its wrong values (values.py, and the tables
api.py, restore.py, commands.py), each a :class:`GenCase` that runs the call and says in which phase it failed.
Each public callable also gets one valid baseline case, which must be accepted: the proof that the wrong values
are judged against a call that works.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from typing import Any

from conformance.sweep.generated import api, commands, restore, surface
from conformance.sweep.generated import fixtures as fx
from conformance.sweep.generated.runner import GenCase, Outcome, Skip, Timeout
from conformance.sweep.generated.values import Make, built, shown, text_file, wrong_values

# A parameter's name as errors may spell it.
ALIASES = {
    "ddp": ("ddp", "DistributedDataParallel"),
    "module": ("module", "nn.Module"),
    "process_group": ("process_group", "process group"),
    "params": ("params", "parameters"),
    "optimizer_class": ("optimizer_class",),
}
MINE = ("gradsync.comm", "gradsync.optim", "gradsync.data", "gradsync.nn", "gradsync.checkpoint", "gradsync.settings")
MY_TOP = ("DistributedLoader", "DistributedSampler", "LengthGroupedSampler", "ShardedOptimizer",
          "ZeroRedundancyOptimizer", "SyncBatchNorm")  # fmt: skip


def owner(target: str, declared: str) -> str:
    """Whose surface a target is: mine (this slice), torch (re-exported), or the engineer's area it belongs to."""
    if declared != "mine":
        return declared
    if target.startswith(MINE) or target.rsplit(".", 1)[-1] in MY_TOP:
        return "mine"
    return target.split(".")[1] if "." in target else target


def _shows_of(value: Any) -> list[str]:
    if isinstance(value, str) and not value:
        return ["''", '""', "empty"]
    if isinstance(value, str) and len(value) > 60:
        return [value]
    return shown(value)


# --------------------------------------------------------------------------------------------------- the API
def api_cases() -> list[GenCase]:
    cases = []
    for name, obj in surface.public_callables().items():
        target = api.TABLE.get(name)
        if target is None:
            continue
        who = owner(name, target.owner)
        cases.append(
            GenCase(
                "api", name, "(baseline)", "valid", None, _api_run(obj, target, None, None), (), (), who, valid=True
            )
        )
        for p in surface.parameters(obj):
            domain = target.params[p.name]
            for label, value in wrong_values(domain):
                names = ALIASES.get(p.name, (p.name,))
                run = _api_run(obj, target, p.name, value)
                cases.append(GenCase("api", name, p.name, label, value, run, names, _shows_of(value), who))
            for label, value in domain.good:
                run = _api_run(obj, target, p.name, value)
                cases.append(GenCase("api", name, p.name, label, value, run, (), (), who, valid=True))
    return cases


def _api_run(
    obj: Callable[..., Any], target: api.Target, param: str | None, value: Any
) -> Callable[[GenCase], Outcome]:
    def run(case: GenCase) -> Outcome:
        if target.group:
            fx.group1()
        kwargs = target.kwargs()
        if param is not None:
            kwargs[param] = built(value)
            if isinstance(value, Make) and isinstance(kwargs[param], str):  # a path: showing it names the argument
                case.shows = _shows_of(kwargs[param])
                case.names = [*case.names, kwargs[param]]
            elif isinstance(value, Make):
                case.shows = list(value.shows) or [type(kwargs[param]).__name__]
        outcome = _call_then_use(lambda: obj(**{k: v for k, v in kwargs.items() if not k.startswith("_")}),
                                 None if target.use is None else lambda made: target.use(made, kwargs))  # fmt: skip
        damage = target.disk(kwargs) if target.disk is not None and outcome.error is not None else None
        if damage:
            outcome.problems.append(f"corrupted on disk: {damage}")
        return outcome

    return run


def _call_then_use(call: Callable[[], Any], use: Callable[[Any], Any] | None) -> Outcome:
    try:
        made = call()
    except Timeout:
        raise
    except Exception as exc:
        return Outcome(exc, "given")
    if use is None:
        return Outcome()
    try:
        use(made)
    except Timeout:
        raise
    except Exception as exc:
        return Outcome(exc, "use")
    return Outcome()


# ------------------------------------------------------------------------------------------------ restored state
def restore_cases() -> list[GenCase]:
    cases = []
    for name, entry in restore.RESTORED.items():
        where = f"{name}.load_state_dict" if not name.endswith("restore") else name
        who = owner(name, entry.owner)
        run = _restore_run(entry, Make(entry.valid_state, "its own kind's state"))
        cases.append(GenCase("restore", where, "(baseline)", "valid", None, run, (), (), who, valid=True))
        for label, state in entry.states:
            run = _restore_run(entry, state)
            cases.append(GenCase("restore", where, "state", label, state, run, ("state", "checkpoint"), (), who))
    return cases


def _restore_run(entry: restore.Restored, state: Any) -> Callable[[GenCase], Outcome]:
    def run(case: GenCase) -> Outcome:
        fx.group1()
        obj = entry.make()
        bad = built(state)
        return _call_then_use(lambda: entry.load(obj, bad) or obj, lambda _: entry.use(obj))

    return run


# --------------------------------------------------------------------------------------------- command lines
class Launched(Exception):
    """The command got past every check to starting its workers: its flags were accepted."""


def _no_launch() -> None:
    import gradsync.launch.elastic as elastic_launcher
    import gradsync.launch.run as launcher

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise Launched()

    launcher.elastic_launch = refuse  # type: ignore[assignment]
    elastic_launcher.run_elastic = refuse  # type: ignore[assignment]


def _script() -> str:
    return text_file("print('ran')\n", ".py")


def _cli(argv: list[str]) -> Outcome:
    from gradsync import cli

    _no_launch()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
    except Launched:
        return Outcome(text=err.getvalue())
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    except Timeout:
        raise
    except Exception as exc:
        return Outcome(exc, problems=["a traceback where one line with exit 2 was due"])
    return _judged_exit(code, err.getvalue())


def _judged_exit(code: int, text: str) -> Outcome:
    problems = [] if code == 2 else [f"exit code {code}, expected 2"]
    lines = [line for line in text.splitlines() if line.strip()]
    if "usage:" not in text and len(lines) > 1:
        problems.append(f"{len(lines)} lines on stderr, expected one")
    if "Traceback" in text:
        problems.append("printed a traceback")
    return Outcome(code=code or 1, text=text, problems=problems)


def flag_cases() -> list[GenCase]:
    cases = []
    for command, flags in (("run", surface.run_flags()), ("doctor", surface.doctor_flags())):
        for dest, action in flags.items():
            values = commands.flag_values(action)
            if isinstance(values, str):
                continue
            option = (
                action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
            )
            names = tuple(action.option_strings) + (dest,)
            for label, value in values:
                run = _flag_run(command, dest, option, value)
                cases.append(GenCase(f"{command} flag", f"gradsync {command}", option, label, value, run, names,
                                     _shows_of(value), "cli"))  # fmt: skip
    return cases


def _flag_run(command: str, dest: str, option: str, value: Any) -> Callable[[GenCase], Outcome]:
    def run(case: GenCase) -> Outcome:
        v = built(value)
        if isinstance(value, Make):
            case.shows = [v]
        base = [] if dest == "nproc_per_node" else ["--nproc-per-node", "1"]
        argv = [*base, *commands.MODE.get(dest, []), f"{option}={v}"]
        if command == "run":
            return _cli(["run", *argv, _script()])
        return _doctor(argv)

    return run


def _doctor(argv: list[str]) -> Outcome:
    from gradsync.doctor import job as doctor_job
    from gradsync.errors import GradsyncError

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            job, _ = doctor_job.parse(argv)
    except SystemExit as exc:
        return _judged_exit(exc.code if isinstance(exc.code, int) else 2, err.getvalue())
    except Timeout:
        raise
    except GradsyncError:  # a value the parser refuses: the command's refusal, judged as the CLI says it
        return _cli(["doctor", *argv])
    except Exception as exc:
        return Outcome(exc, problems=["a traceback where a refusal or a failed check was due"])
    result = doctor_job.check_flags(job)
    if result.status != "fail":
        return Outcome()
    return Outcome(code=2, text=f"{result.detail} {result.fix}")


def rdzv_cases() -> list[GenCase]:
    cases = []
    for key in surface.rdzv_conf_keys():
        values, companions = commands.RDZV_CONF[key]
        for label, value in values:
            run = _rdzv_run(key, value, companions)
            cases.append(GenCase("rdzv-conf", "gradsync run --rdzv-conf", key, label, value, run, (key,),
                                 _shows_of(value), "cli"))  # fmt: skip
    return cases


def _rdzv_run(key: str, value: Any, companions: dict[str, Any]) -> Callable[[GenCase], Outcome]:
    def run(case: GenCase) -> Outcome:
        v = built(value)
        if isinstance(value, Make):
            case.shows = [v]
        pairs = {**{k: built(c) for k, c in companions.items()}, key: v}
        if key not in ("protocol",):
            pairs.setdefault("protocol", "https")
        conf = ",".join(f"{k}={x}" for k, x in pairs.items())
        argv = ["run", "--nproc-per-node", "1", *commands.ETCD, "--rdzv-conf", conf, _script()]
        return _cli(argv)

    return run


def environment_cases() -> list[GenCase]:
    cases = []
    for variable in surface.environment_variables():
        entry = commands.VARIABLES[variable]
        if isinstance(entry, str):
            continue
        values, reader = entry
        who = "mine" if reader == "ddp" else "elastic" if reader != "init" else "runtime"
        for label, value in values:
            run = _env_run(variable, value, commands.READERS[reader])
            cases.append(
                GenCase("environment", variable, variable, label, value, run, (variable,), _shows_of(value), who)
            )
    return cases


def _env_run(variable: str, value: str, reader: Callable[[], None]) -> Callable[[GenCase], Outcome]:
    def run(case: GenCase) -> Outcome:
        os.environ[variable] = value
        return _call_then_use(reader, None)

    return run


def all_cases() -> list[GenCase]:
    return [*api_cases(), *restore_cases(), *flag_cases(), *rdzv_cases(), *environment_cases()]


__all__ = ["Skip", "all_cases"]
