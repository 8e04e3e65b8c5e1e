"""Observability: events are consistent, the trace is valid Chrome-trace JSON, the report draws a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import gradsync
from gradsync.observe import Monitor, median_breakdown, read_steps
from gradsync.observe.breakdown import breakdowns
from gradsync.observe.report import main as report_main
from gradsync.testing import spawn


def _four_layers() -> tuple[nn.Module, gradsync.DistributedDataParallel, torch.optim.Optimizer]:
    """Four linear layers in buckets of ~15 KB (several buckets a step), and their SGD."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=0.015)
    return model, ddp, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(rank: int, world_size: int, trace: str) -> dict:
    model, ddp, opt = _four_layers()
    monitor = Monitor(ddp, opt)
    for _ in range(5):
        opt.zero_grad()
        ddp(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():
        ddp(torch.randn(2, 64))  # evaluation is not a step
    scalars: dict[str, float] = {}

    class Writer:  # what Monitor needs of torch.utils.tensorboard.SummaryWriter
        def add_scalar(self, tag: str, value: float, step: int) -> None:
            scalars[tag] = value

    monitor.log_to_tensorboard(Writer(), global_step=5)
    monitor.export_chrome_trace(trace)
    monitor.print_summary()
    layout = monitor.bucket_layout()
    monitor.detach()
    ddp(torch.randn(2, 64)).sum().backward()  # detached: not recorded
    return {
        "scalars": scalars,
        "steps": monitor.steps,
        "nparams": len(list(model.parameters())),
        "nbytes": sum(p.numel() * 4 for p in model.parameters()),
        "breakdown": monitor.breakdown(),
        "layout": layout,
    }


@pytest.mark.timeout(90)
def test_events_trace_and_report(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    results = spawn(_train, args=(str(trace),), timeout=80)
    for res in results:
        steps = res["steps"]
        assert len(steps) == 5
        assert len(steps[0].buckets) == 1  # iteration 1 is one bucket, as torch's (BucketCaps.first_limits)
        for s in steps:
            assert s.forward_start <= s.forward_end <= s.backward_start <= s.backward_end <= s.comm_end
            assert s.comm_end <= s.optimizer_start <= s.optimizer_end
            assert len(s.buckets) >= 3 or s is steps[0]
            assert sum(b.nparams for b in s.buckets) == res["nparams"]  # every parameter, once
            assert sum(b.nbytes for b in s.buckets) == res["nbytes"]
            for b in s.buckets:
                assert s.backward_start <= b.ready <= b.launch <= b.done <= s.comm_end
        assert set(res["scalars"]) == {
            f"gradsync/{k}" for k in ("forward", "backward", "exposed_comm", "optimizer", "total", "overlap", "bytes")
        }
        assert res["scalars"]["gradsync/bytes"] == res["nbytes"]
        assert res["layout"].startswith(f"{len(steps[-1].buckets)} bucket(s) of ")
        assert "tuned" not in res["layout"]  # an explicit bucket_cap_mb is never tuned
        b = res["breakdown"]
        assert 0.0 <= b.overlap <= 1.0
        for one in breakdowns(res["steps"]):  # per step (medians of parts need not add up to the median total)
            assert one.total >= one.forward + one.backward + one.exposed_comm - 1e-9

    data = json.loads(trace.read_text())
    assert {e["ph"] for e in data["traceEvents"]} == {"X", "M"}
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float) for e in slices)
    assert any(e["name"].startswith("all-reduce bucket") for e in slices)
    per_rank = read_steps(trace)
    assert sorted(per_rank) == [0, 1] and median_breakdown(per_rank[0]) is not None

    png = tmp_path / "report.png"
    assert report_main([str(trace), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _DeviceClock:
    """A stand-in for a GPU's clock: every mark is 1 s of device time after the last, and done only when the test
    says so (or a reader waits for it)."""

    def __init__(self) -> None:
        self.time = 0.0
        self.marks: list[dict] = []
        self.waited = 0

    def mark(self) -> dict:
        self.time += 1.0
        self.marks.append({"t": self.time, "done": False})
        return self.marks[-1]

    def mark_after(self, future: torch.futures.Future) -> dict:
        return self.mark()

    def done(self, mark: dict) -> bool:
        return mark["done"]

    def seconds(self, start: dict, end: dict) -> float:
        if not end["done"]:
            self.waited += 1
            end["done"] = True
        return end["t"] - start["t"]

    def finish_all(self) -> None:
        for mark in self.marks:
            mark["done"] = True


def test_a_device_clock_places_the_gpu_timeline_and_is_read_only_when_done() -> None:
    """On a GPU the recorder's times are the device's marks, not the host's launches; marks still running are
    read later, never waited for in the step, and reading ``steps`` waits for the rest."""
    from types import SimpleNamespace

    from gradsync.observe.recorder import StepRecorder

    clock = _DeviceClock()
    recorder = StepRecorder(clock=clock)  # type: ignore[arg-type]
    done = torch.futures.Future()
    done.set_result(None)
    bucket = SimpleNamespace(index=0, nbytes=4, param_indices=[0])
    recorder.forward_start()
    recorder.forward_end()
    recorder.backward_start([bucket])
    recorder.bucket_ready(0)
    recorder.bucket_launched(0, done)
    recorder.backward_end()
    recorder.comm_end()
    recorder.forward_start()  # the next step: nothing of the last one is done on the device yet
    first = recorder._steps[0]
    assert first.forward_end == 0.0 and clock.waited == 0
    clock.finish_all()
    recorder.forward_start()  # now they are: read without waiting
    assert clock.waited == 0 and first.forward_end > 0.0
    # 1 s of device time between consecutive marks: the spans are the device's, though the host took microseconds.
    assert first.forward_end - first.forward_start == pytest.approx(1.0)
    b = first.buckets[0]
    assert (b.ready - first.backward_start, b.launch - b.ready, b.done - b.launch) == pytest.approx((1.0, 1.0, 1.0))
    assert first.comm_end - b.done == pytest.approx(2.0)  # backward_end came between
    recorder.forward_end()
    steps = recorder.steps  # the last step's start and forward end are still running: reading waits for them
    assert clock.waited == 2 and steps[-1].forward_end - steps[-1].forward_start == pytest.approx(1.0)


def _train_to_tensorboard(rank: int, world_size: int, logdir: str) -> dict:
    from torch.utils.tensorboard import SummaryWriter

    model, ddp, opt = _four_layers()
    monitor = Monitor(ddp, opt)
    writer = SummaryWriter(f"{logdir}/rank{rank}")
    for step in range(6):
        opt.zero_grad()
        ddp(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        if step >= 2:
            monitor.log_to_tensorboard(writer, global_step=step)
    writer.close()
    breakdown = monitor.breakdown()
    return {"bytes": breakdown.bytes, "total": breakdown.total}


@pytest.mark.timeout(90)
def test_the_monitor_writes_to_a_real_tensorboard_event_file(tmp_path: Path) -> None:
    """torch's SummaryWriter, and the event file read back with TensorBoard's own reader (the `tensorboard`
    package, in the test extras)."""
    pytest.importorskip("tensorboard", reason="the tensorboard package (pip install -e '.[test]') is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = spawn(_train_to_tensorboard, args=(str(tmp_path),), timeout=80)
    for rank, res in enumerate(results):
        events = EventAccumulator(str(tmp_path / f"rank{rank}"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        wanted = {"forward", "backward", "exposed_comm", "optimizer", "total", "overlap", "bytes"}
        assert tags == {f"gradsync/{k}" for k in wanted}
        assert [e.step for e in events.Scalars("gradsync/total")] == [2, 3, 4, 5]
        assert events.Scalars("gradsync/bytes")[-1].value == res["bytes"]
        assert events.Scalars("gradsync/total")[-1].value == pytest.approx(res["total"], rel=1e-6)


def _profiled(rank: int, world_size: int, folder: str) -> None:
    model, ddp, opt = _four_layers()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            opt.zero_grad()
            ddp(torch.randn(16, 64)).pow(2).mean().backward()
            opt.step()
            prof.step()
    prof.export_chrome_trace(f"{folder}/rank{rank}.json")


@pytest.mark.timeout(120)
def test_a_torch_profiler_trace_of_a_gradsync_job_is_what_holistic_trace_analysis_reads(tmp_path: Path) -> None:
    """gradsync's collectives are torch.distributed's, so torch.profiler's trace of a gradsync job carries the
    `distributedInfo` block (rank, world size, backend) and every bucket's all-reduce, and HTA loads the ranks'
    traces as one job. Its communication/computation overlap counts GPU kernels: a CPU (gloo) trace has none, so it
    is undefined here (NaN); on CPU, the Monitor's breakdown gives the overlap instead."""
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis (pip install -e '.[traces]')")
    spawn(_profiled, args=(str(tmp_path),), timeout=100)
    for rank in range(2):
        trace = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        assert trace["distributedInfo"]["backend"] == "gloo"
        reduces = [e for e in trace["traceEvents"] if e.get("name") == "gloo:all_reduce"]
        assert len(reduces) >= 4 * 3  # 4 steps, at least 3 buckets each
    analysis = hta.TraceAnalysis(trace_dir=str(tmp_path))
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    assert sorted(overlap["rank"]) == [0, 1]
