"""LengthGroupedSampler: every sample once per epoch across ranks (torch's repeats, or torch's tail dropped), the
same batches on every rank's count, less padding than random batches, a resume that neither replays nor skips, and
two gloo ranks training through it without a hang."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

import gradsync
from gradsync import checkpoint
from gradsync.data import DistributedSampler, LengthGroupedSampler
from gradsync.data.length_grouped import group_by_length, group_by_length_reference
from gradsync.data.sampler import epoch_order
from gradsync.errors import ConfigError
from gradsync.testing import spawn


def long_tailed(n: int, seed: int = 0) -> list[int]:
    """Lengths like text's: most short, a few long (log-normal, as sentence lengths roughly are)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.empty(n).log_normal_(3.0, 1.0, generator=g).clamp(1, 2000)).long().tolist()


def every_rank(n: int, world: int, batch: int, **kwargs) -> list[LengthGroupedSampler]:
    lengths = long_tailed(n)
    return [LengthGroupedSampler(range(n), batch, lengths, world, rank, **kwargs) for rank in range(world)]


def padding(ranks: list[list[list[int]]], lengths: list[int]) -> float:
    padded = sum(len(b) * max(lengths[i] for i in b) for batches in ranks for b in batches)
    return 1 - sum(lengths[i] for batches in ranks for b in batches for i in b) / padded


GRID = list(itertools.product([0, 1, 7, 101], [1, 2, 3, 8], [1, 3, 8], [True, False]))


@pytest.mark.parametrize("n,world,batch,drop_last", GRID)
def test_every_sample_once_across_ranks_with_equal_batches(n: int, world: int, batch: int, drop_last: bool) -> None:
    samplers = every_rank(n, world, batch, drop_last=drop_last, seed=4, megabatch_mult=2)
    for epoch in (0, 3):
        for s in samplers:
            s.set_epoch(epoch)
        ranks = [list(s) for s in samplers]
        seen = Counter(i for batches in ranks for b in batches for i in b)
        if drop_last:  # torch's order cut to whole global batches: each kept sample once, the order's tail dropped
            kept = n // (world * batch) * world * batch
            assert seen == Counter(epoch_order(n, True, 4, epoch)[:kept])
        else:  # torch's DistributedSampler's samples exactly, its repeats included
            torch_ranks = [DistributedSampler(range(n), world, r, seed=4) for r in range(world)]
            for t in torch_ranks:
                t.set_epoch(epoch)
            assert seen == Counter(i for t in torch_ranks for i in t)
        # every rank the same number of batches, and the k-th batch the same size on every rank
        assert {len(batches) for batches in ranks} == {samplers[0].num_batches} == {len(s) for s in samplers}
        sizes = [[len(b) for b in batches] for batches in ranks]
        assert all(s == sizes[0] for s in sizes)
        assert sum(size != batch for size in sizes[0]) <= (0 if drop_last else 1)


@pytest.mark.parametrize("megabatch", [1, 3, 16, 1000])
def test_the_grouping_is_the_plain_python_rule(megabatch: int) -> None:
    g = torch.Generator().manual_seed(megabatch)
    lengths = torch.randint(0, 6, (200,), generator=g)  # many ties: their order must be kept as the reference keeps it
    slots = torch.cat([torch.randperm(200, generator=g), torch.randperm(200, generator=g)[:37]])
    fast = group_by_length(slots, lengths, megabatch).tolist()
    assert fast == group_by_length_reference(slots.tolist(), lengths.tolist(), megabatch)


def test_batches_hold_similar_lengths_and_the_longest_comes_first() -> None:
    samplers = every_rank(3000, 4, 8)
    lengths = samplers[0].lengths.tolist()
    ranks = [list(s) for s in samplers]
    shares = [list(DistributedSampler(range(3000), 4, r)) for r in range(4)]
    random = [[share[i : i + 8] for i in range(0, len(share), 8)] for share in shares]  # what DataLoader batches
    assert padding(ranks, lengths) < padding(random, lengths) / 3, (padding(ranks, lengths), padding(random, lengths))
    assert max(lengths[i] for batches in ranks for i in batches[0]) == max(lengths)


def test_deterministic_per_epoch_and_different_between_epochs() -> None:
    first, again = every_rank(500, 2, 4)[1], every_rank(500, 2, 4)[1]  # built apart, as two runs would be
    for epoch in (0, 1):
        first.set_epoch(epoch)
        again.set_epoch(epoch)
        assert list(first) == list(again)
    first.set_epoch(0)
    epoch0 = list(first)
    first.set_epoch(1)
    assert list(first) != epoch0
    assert list(every_rank(500, 2, 4, seed=1)[1]) != epoch0
    unshuffled = every_rank(500, 2, 4, shuffle=False)[1]
    unshuffled.set_epoch(5)
    assert list(unshuffled) == list(every_rank(500, 2, 4, shuffle=False)[1])


@pytest.mark.parametrize("cut", [0, 1, 9, 16])  # start, middle, the last batch, past the end of a 16-batch share
def test_resume_yields_exactly_the_remaining_batches_then_whole_epochs(cut: int) -> None:
    first = every_rank(250, 2, 8, seed=3)[1]
    first.set_epoch(2)
    full = list(first)
    assert len(full) == 16
    it = iter(first)
    taken = [next(it) for _ in range(cut)]
    state = first.state_dict()
    assert state["batches_consumed"] == cut

    resumed = every_rank(250, 2, 8, seed=3)[1]
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the usual loop calls set_epoch again for the epoch it resumes
    assert len(resumed) == 16 - cut
    assert taken + list(resumed) == full
    first.set_epoch(3)
    resumed.set_epoch(3)
    assert list(resumed) == list(first) and len(resumed) == 16


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_through_a_dataloader_and_a_checkpoint(num_workers: int, tmp_path: Path) -> None:
    """A DataLoader draws batches ahead of the loop (with workers); ``batches_consumed`` says where the loop was."""
    texts = [torch.full((n,), i) for i, n in enumerate(long_tailed(90))]
    make = lambda: LengthGroupedSampler(texts, 4, num_replicas=2, rank=0, seed=1)  # lengths read from the items
    pad = lambda batch: pad_sequence(batch, batch_first=True, padding_value=-1)
    ids = lambda tokens: tokens[:, 0].tolist()
    sampler = make()
    whole = [ids(t) for t in DataLoader(texts, batch_sampler=sampler, collate_fn=pad)]
    sampler = make()
    seen = []
    for step, tokens in enumerate(DataLoader(texts, batch_sampler=sampler, collate_fn=pad, num_workers=num_workers)):
        seen.append(ids(tokens))
        if step == 4:
            checkpoint.save(tmp_path / "ckpt.pt", sampler=sampler.state_dict(batches_consumed=step + 1))
            break
    sampler = make()
    checkpoint.restore(checkpoint.load(tmp_path / "ckpt.pt"), sampler=sampler)
    seen += [ids(t) for t in DataLoader(texts, batch_sampler=sampler, collate_fn=pad, num_workers=num_workers)]
    assert seen == whole


def test_world_and_rank_come_from_the_process_group(group_of_one) -> None:
    s = LengthGroupedSampler(range(5), 2, [1] * 5)
    assert (s.num_replicas, s.rank) == (1, 0)
    group = dist.new_group([0])
    s = LengthGroupedSampler(range(5), 2, [1] * 5, process_group=group)
    assert (s.num_replicas, s.rank, len(s)) == (1, 0, 3)


def test_bad_input_is_named() -> None:
    cases = [
        (dict(lengths=[1, 2]), r"2 lengths for a dataset of 4 samples"),
        (dict(lengths=[1, 2, -3, 4]), r"lengths\[2\] is -3"),
        (dict(lengths=[1.5, 2, 3, 4]), r"lengths must be a flat sequence of ints"),
        (dict(lengths=["a", "b", "c", "d"]), r"lengths must be a sequence of ints"),
        (dict(batch_size=0), r"batch_size must be an int >= 1, got int 0"),
        (dict(batch_size=2.0), r"batch_size must be an int >= 1, got float"),
        (dict(num_replicas=2, rank=2), r"rank 2 is outside \[0, 1\] \(num_replicas\)"),
        (dict(num_replicas=0, rank=0), r"num_replicas must be >= 1"),
        (dict(megabatch_mult=0), r"megabatch_mult must be an int >= 1"),
    ]
    for overrides, message in cases:
        kwargs = {"batch_size": 2, "lengths": [1, 2, 3, 4], **overrides}
        with pytest.raises(ConfigError, match=message):
            LengthGroupedSampler(range(4), **kwargs)
    with pytest.raises(ValueError, match=r"dataset\[0\] \(int\) has no length to group by; pass lengths="):
        LengthGroupedSampler(range(4), 2)
    with pytest.raises(ConfigError, match="needs a map-style dataset"):
        LengthGroupedSampler(iter(range(4)), 2, [1] * 4)  # type: ignore[arg-type]
    sampler = LengthGroupedSampler(range(10), 2, list(range(10)), num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match=r"set_epoch: epoch must be an int"):
        sampler.set_epoch(1.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"batches_consumed=4 is outside \[0, 3\]"):
        sampler.state_dict(batches_consumed=4)
    state = sampler.state_dict()
    for other, key in (
        (LengthGroupedSampler(range(10), 2, [1] * 10, num_replicas=2, rank=0), "lengths_crc32"),
        (LengthGroupedSampler(range(10), 3, list(range(10)), num_replicas=2, rank=0), "batch_size"),
        (LengthGroupedSampler(range(10), 2, list(range(10)), num_replicas=1, rank=0), "num_replicas"),
        (LengthGroupedSampler(range(10), 2, list(range(10)), num_replicas=2, rank=0, seed=9), "seed"),
    ):
        with pytest.raises(ConfigError, match=f"was saved with {key}="):
            other.load_state_dict(state)
    with pytest.raises(ConfigError, match="expected the dict that LengthGroupedSampler.state_dict"):
        sampler.load_state_dict("ckpt.pt")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"batches_consumed=7 is outside \[0, 3\]"):
        sampler.load_state_dict({**state, "batches_consumed": 7})


# ------------------------------------------------------------------------------------------------ two real ranks
def _pad(batch: list[tuple[int, torch.Tensor]]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    index, tokens = zip(*batch)
    padded = pad_sequence(list(tokens), batch_first=True)
    return list(index), padded, padded != 0


def _train_an_epoch(rank: int, world_size: int) -> dict:
    """One epoch of a tiny bag-of-embeddings model under gradsync's DDP, batches from LengthGroupedSampler: what
    each step saw, and the loss all-reduced each step (which hangs if one rank runs out of batches first)."""
    torch.manual_seed(0)
    lengths = long_tailed(45, seed=7)
    data = [(i, torch.randint(1, 50, (n,), generator=torch.Generator().manual_seed(i))) for i, n in enumerate(lengths)]
    sampler = LengthGroupedSampler(data, batch_size=4, lengths=lengths, seed=2)  # world and rank from the group
    model = gradsync.DistributedDataParallel(torch.nn.EmbeddingBag(50, 4, mode="sum", padding_idx=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    sampler.set_epoch(1)
    for index, tokens, _ in DataLoader(data, batch_sampler=sampler, collate_fn=_pad):
        opt.zero_grad()
        model(tokens).pow(2).mean().backward()  # the gradients' all-reduce: every rank must get here each step
        opt.step()
        seen.append(index)
    return {"seen": seen, "batches": len(sampler)}


@pytest.mark.timeout(90)
def test_two_ranks_train_an_epoch_and_see_every_sample_once() -> None:
    ranks = spawn(_train_an_epoch, 2, timeout=60, pg_timeout=20)
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == ranks[0]["batches"] == 6  # ceil(ceil(45/2)/4)
    seen = Counter(i for r in ranks for b in r["seen"] for i in b)
    torch_sampler = [DistributedSampler(range(45), 2, r, seed=2) for r in range(2)]
    for t in torch_sampler:
        t.set_epoch(1)
    assert seen == Counter(i for t in torch_sampler for i in t)  # 45 samples once, one of them twice (torch's pad)
    assert sum(seen.values()) == 46 and set(seen) == set(range(45))


# ------------------------------------------------------------------------------------------------ the padding lab
def test_the_padding_lab_runs_on_a_few_modules(tmp_path: Path) -> None:
    from bench.padding.__main__ import main

    out = tmp_path / "padding.json"
    assert main(["--max-files", "60", "--batch-sizes", "4", "--worlds", "2", "--epochs", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["corpus"]["samples"] > 200 and "standard library" in result["corpus"]["source"]
    (run,) = result["runs"]
    assert 0 <= run["grouped_padding"] < run["random_padding"] < 1 and run["tokens_per_batch_ratio"] > 1
    assert {"command", "commit"} <= set(result["provenance"])  # written through lab.results, the one writer


# ------------------------------------------------- dict samples (Hugging Face datasets rows; issue 58's sweep)
TOKENS = [list(range(n)) for n in (3, 9, 1, 7, 5, 2, 8, 4, 6, 10)]


def test_dict_rows_are_grouped_by_their_input_ids_as_transformers_does() -> None:
    """Rows {"input_ids", "attention_mask"} were grouped by len(row), 2 for every sample: no grouping at all."""
    rows = [{"input_ids": t, "attention_mask": [1] * len(t)} for t in TOKENS]
    by_rows = LengthGroupedSampler(rows, batch_size=2, num_replicas=2, rank=1, seed=3)
    by_lengths = LengthGroupedSampler(
        rows, batch_size=2, num_replicas=2, rank=1, seed=3, lengths=[len(t) for t in TOKENS]
    )
    assert by_rows.lengths.tolist() == [len(t) for t in TOKENS]
    assert list(by_rows) == list(by_lengths)


def test_model_input_name_names_the_field_to_measure() -> None:
    rows = [{"text": "x" * 50, "labels": t, "prompt": t[:1]} for t in TOKENS]
    sampler = LengthGroupedSampler(rows, batch_size=2, num_replicas=1, rank=0, model_input_name="labels")
    assert sampler.lengths.tolist() == [len(t) for t in TOKENS]


def test_rows_whose_sequences_share_one_length_use_it() -> None:
    rows = [{"ids": t, "mask": [1] * len(t), "source": "web"} for t in TOKENS]
    assert LengthGroupedSampler(rows, 2, num_replicas=1, rank=0).lengths.tolist() == [len(t) for t in TOKENS]


def test_ambiguous_dict_rows_and_a_missing_field_are_refused_by_name() -> None:
    rows = [{"question": t, "answer": t[: max(1, len(t) // 2)]} for t in TOKENS]
    with pytest.raises(ConfigError, match=r"dataset\[0\] is a dict without 'input_ids'.*model_input_name='FIELD'"):
        LengthGroupedSampler(rows, batch_size=2, num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match=r"model_input_name='tokens', but dataset\[0\] has no such field"):
        LengthGroupedSampler(rows, batch_size=2, num_replicas=1, rank=0, model_input_name="tokens")
    with pytest.raises(ConfigError, match="model_input_name='tokens' names a field of dict samples"):
        LengthGroupedSampler(TOKENS, batch_size=2, num_replicas=1, rank=0, model_input_name="tokens")


def test_a_string_for_a_switch_is_refused() -> None:
    """shuffle="false" from a config file is true in Python: it shuffled."""
    with pytest.raises(ConfigError, match="LengthGroupedSampler: shuffle must be True or False, got str 'false'"):
        LengthGroupedSampler(TOKENS, batch_size=2, num_replicas=1, rank=0, shuffle="false")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="DistributedSampler: drop_last must be True or False, got str 'no'"):
        DistributedSampler(TOKENS, num_replicas=1, rank=0, drop_last="no")  # type: ignore[arg-type]
