"""The benchmark runner end to end, tiny: two loopback ranks, interleaved variants, JSON (with the command and
commit that made it) and PNG out; and ``gradsync bench``, which says where the benchmarks are (the library never
imports them: tests/test_layers.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long
@pytest.mark.timeout(120)
def test_bench_writes_ratios_tuning_and_a_png(tmp_path: Path) -> None:
    out = tmp_path / "cnn.json"  # 1 MiB of gradients: enough for the tuner to probe (tiny models are not tuned)
    variants = "local;torch;gradsync;gradsync:tune=0;gradsync:static=1,view=1"
    subprocess.run(
        [sys.executable, "-m", "bench", "--model", "cnn", "--variants", variants, "--steps", "3", "--warmup", "2"]
        + ["--batch", "4", "--timeout", "100", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=110,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert list(result["variants"]) == variants.split(";")
    for spec, entry in result["variants"].items():
        assert len(entry["steps_ms"]) == 3 and entry["median_ms"] > 0, spec
        assert entry["ratio_vs_torch"] > 0, spec
    assert result["variants"]["torch"]["ratio_vs_torch"] == 1.0
    # The tuner decided (and said so) where it was on, and nowhere else.
    assert "bucket cap" in result["variants"]["gradsync"]["bucket_tuning"]
    assert result["variants"]["gradsync:tune=0"]["bucket_tuning"] is None
    assert out.with_suffix(".png").stat().st_size > 10_000
    made_by = result["provenance"]
    assert made_by["command"].startswith("python -m bench --model cnn --variants"), made_by
    assert made_by["argv"][-2:] == ["--out", str(out)]
    assert re.fullmatch("[0-9a-f]{40}", made_by["commit"]) and isinstance(made_by["dirty"], bool), made_by


@pytest.mark.long
@pytest.mark.timeout(180)
def test_tensor_parallel_bench_times_both_ddps_over_one_tp_model(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    subprocess.run(
        [sys.executable, "-m", "bench.tensor_parallel", "--link", "loopback", "--runs", "1", "--steps", "2"]
        + ["--dim", "32", "--layers", "1", "--timeout", "150", "--port", "0", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=170,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert set(result["median_ms"]) == {"torch", "gradsync", "gradsync:tune=0"}, result
    assert all(ms > 0 for ms in result["median_ms"].values()) and result["link_bound_ms"] is None, result
    assert result["ratio_vs_torch"]["torch"] == 1.0 and sum(result["bucket_mib"]["torch"]) > 0, result
    (run,) = result["runs"]
    assert run["averaged_mib_per_dp_rank"] * 2**20 == 4 * (2 * 32 + 32 * 64 + 64 + 32 * 64 + 32), run  # tp halves


@pytest.mark.long
@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", ["inner", "outer"])
def test_compiled_bench_splits_gradsyncs_graph_and_reports_exposed_communication(tmp_path: Path, order: str) -> None:
    """--compile: the figure is a compiled one only if dynamo split gradsync's graph (recorded per variant)."""
    out = tmp_path / "mlp.json"
    subprocess.run(
        [sys.executable, "-m", "bench", "--model", "mlp", "--variants", "local;torch;gradsync", "--steps", "2"]
        + ["--warmup", "2", "--batch", "4", "--compile", order, "--backend", "aot_eager", "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=230,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert result["compile"] == order and result["backend"] == "aot_eager"
    assert result["variants"]["gradsync"]["graph_split"] > 0
    assert result["variants"]["gradsync"]["bucket_tuning"] is None  # a compiled model keeps its caps
    for spec in ("torch", "gradsync"):
        assert result["variants"][spec]["exposed_comm_ms"] >= 0, spec


def test_gradsync_bench_points_to_the_source_checkout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--model", "mlp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python -m bench" in err, err


# Files that write JSON another process reads and merges (temporary, not results), with why they do not record
# their own provenance: the parent that keeps the result records its command.
INTERMEDIATE = {
    "bench/scale/probe.py": "the link probe's timings, in a temporary file the scaling lab reads",
    "bench/elastic/chaos.py": "the faults it injected, beside the run's records for a failure's diagnosis",
    "bench/elastic/overhead_worker.py": "per-rank step times; it runs on another checkout with --source",
    "bench/store_load/record_worker.py": "a real rank's store operations, which the store benchmark compares",
    "conformance/torch_suite/run_one.py": "one test's outcome, merged into torch_suite.json",
    "conformance/sweep/child.py": "one case's outcome, merged into sweep.json",
    "conformance/sweep/zygote.py": "one case's outcome, merged into sweep.json",
    "conformance/sweep/cases/launcher.py": "a case's input file",
}


def test_every_result_file_goes_through_the_one_writer() -> None:
    """lab.results.write_json records the command line and commit; a lab writing JSON another way would not."""
    writes = re.compile(r"json\.dump\(|write_text\(json\.dumps|_file\(json\.dumps")
    found = sorted(
        str(path.relative_to(ROOT))
        for folder in ("bench", "conformance")
        for path in (ROOT / folder).rglob("*.py")
        if writes.search(path.read_text())
    )
    assert found == sorted(INTERMEDIATE), found
