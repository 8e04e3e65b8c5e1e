"""The heart of the suite: N ranks with gradsync's DDP must train exactly like one process on the whole batch,
like torch's DDP (≤ 1e-6), and like the naive one-all-reduce-per-gradient reducer."""

from __future__ import annotations

import pytest
from ddp_cases import Case, max_diff, reference, run_case

from gradsync.testing import spawn
from lab.zoo.toys import build

TINY = ("bucket_cap_mb", 0.0005)  # ~500 bytes: one or two parameters per bucket
VIEW = ("gradient_as_bucket_view", True)
FIND = ("find_unused_parameters", True)

CASES = {
    "mlp-sgd-default": Case(),
    "mlp-adam-default": Case(optimizer="adam"),
    "mlp-sgd-tiny-buckets": Case(ddp_kwargs=(TINY,)),
    "mlp-adam-tiny-buckets-view": Case(optimizer="adam", ddp_kwargs=(TINY, VIEW)),
    "mlp-sgd-view": Case(ddp_kwargs=(VIEW,)),
    "accumulate-no_sync": Case(micro=3, ddp_kwargs=(TINY,)),
    "accumulate-attr-view": Case(micro=3, idiom="attr", optimizer="adam", ddp_kwargs=(TINY, VIEW)),
    "tied-and-frozen": Case(model="tied", ddp_kwargs=(TINY,)),
    "tied-adam-view": Case(model="tied", optimizer="adam", ddp_kwargs=(VIEW,)),
    "batchnorm": Case(model="bn", ddp_kwargs=(TINY,)),
    "nested-outputs": Case(model="nested", optimizer="adam"),
    "unused-on-one-rank": Case(model="sometimes", extra_on_rank0_only=True, ddp_kwargs=(FIND, TINY)),
    "unused-on-one-rank-view-adam": Case(
        model="sometimes", optimizer="adam", extra_on_rank0_only=True, ddp_kwargs=(FIND, VIEW, TINY)
    ),
    "static-graph": Case(model="sometimes", ddp_kwargs=(("static_graph", True), TINY)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_torch_and_naive(name: str) -> None:
    case = CASES[name]
    results = spawn(run_case, world_size=2, args=(case,), timeout=100)
    ref = reference(case, world_size=2)
    module = build(case.model)
    for rank, res in enumerate(results):
        # Buffers are compared on rank 0 only: DDP broadcasts rank 0's before each forward, not after the last.
        only_params = module if rank > 0 else None
        assert max_diff(res["gradsync"], ref, only_params) <= 1e-5, f"rank {rank} vs single process"
        assert max_diff(res["gradsync"], res["naive"], only_params) <= 1e-5, f"rank {rank} vs naive reducer"
        if case.with_torch:
            assert max_diff(res["gradsync"], res["torch"], only_params) <= 1e-6, f"rank {rank} vs torch DDP"
            assert res["gradsync_no_grad"] == res["torch_no_grad"]
    # Replicas stay identical.
    assert max_diff(results[0]["gradsync"], results[1]["gradsync"], module) == 0.0


@pytest.mark.timeout(120)
def test_whole_batch_equivalence_four_ranks() -> None:
    """The paper's claim itself: N ranks × batch B == one process × batch N·B (MLP, SGD momentum, 4 ranks)."""
    case = Case(whole_batch_reference=True, steps=5, ddp_kwargs=(TINY,), with_torch=False)
    results = spawn(run_case, world_size=4, args=(case,), timeout=100)
    ref = reference(case, world_size=4)
    for res in results:
        assert max_diff(res["gradsync"], ref) <= 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [FIND, ("static_graph", True)])
def test_parameter_unused_everywhere_keeps_grad_none(mode: tuple) -> None:
    """`never` is used by no rank: its .grad stays untouched (None), as in torch; with static_graph the first
    step's usage map stands for the later steps."""
    case = Case(model="sometimes", ddp_kwargs=(mode,))
    results = spawn(run_case, world_size=2, args=(case,), timeout=100)
    for res in results:
        assert res["gradsync_no_grad"] == ["never.weight", "never.bias"]
        assert res["torch_no_grad"] == ["never.weight", "never.bias"]
