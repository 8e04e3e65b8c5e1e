"""``python -m bench.padding``: the padding LengthGroupedSampler saves on real text, against random batches.

    python -m bench.padding --batch-sizes 8,32 --worlds 2,8 --epochs 3

The text: every docstring (of each module, class and function) in the Python standard library this interpreter
runs on, its test suites left out, parsed with ``ast`` (nothing imported), each one sample, its length in
whitespace-separated words, truncated at ``--max-length`` as a tokenizer truncates at a model's context. No
network here, so no dataset to download: docstrings are natural language written by hundreds of authors, from
one-line summaries to pages of reference, so their lengths are long-tailed as the sentences and paragraphs of a
fine-tuning corpus are; words stand in for subword tokens (a tokenizer makes ~1.3 tokens of a word, about the same
factor for every sample, so the padding fraction hardly moves).

For each world size and per-rank batch size, over ``--epochs`` epochs: the random baseline is DistributedSampler
(shuffled) with its indices cut into batches as DataLoader does; the grouped one is LengthGroupedSampler. A batch is
padded to its longest sample; the padding fraction is pad tokens / all tokens of every rank's batches, and the
ratio is the random batches' mean padded tokens per batch over the grouped ones' (how many times fewer tokens a
batch computes on, for the same samples). The step padding counts what a synchronous step costs: every rank waits
for the step's costliest batch, so it is 1 - real tokens / (world size x that batch's padded tokens, over steps).
LengthGroupedSampler gives a step's ranks batches of the same lengths, so its two figures are close.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import sysconfig
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from gradsync.data import DistributedSampler, LengthGroupedSampler
from lab.results import write_json

_NOT_LIBRARY = {"test", "tests", "idle_test", "site-packages", "dist-packages"}
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_files(max_files: int | None) -> list[Path]:
    """The standard library's modules in a fixed order, its test suites and installed packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _NOT_LIBRARY & set(p.relative_to(root).parts))
    return files[:max_files]


def docstring_lengths(files: Sequence[Path]) -> list[int]:
    """Each non-empty docstring's length in words; a file Python cannot parse (the library keeps a few deliberately
    broken ones) is skipped."""
    lengths = []
    for path in files:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node, clean=False) if isinstance(node, _DOCUMENTED) else None
            if doc and doc.split():
                lengths.append(len(doc.split()))
    return lengths


def random_batches(n: int, world: int, batch: int, epoch: int) -> list[list[list[int]]]:
    """Every rank's batches: DistributedSampler's shuffled share, cut into batches in order (DataLoader's way)."""
    ranks = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), world, rank, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        share = list(sampler)
        ranks.append([share[i : i + batch] for i in range(0, len(share), batch)])
    return ranks


def grouped_batches(lengths: list[int], world: int, batch: int, epoch: int, mult: int) -> list[list[list[int]]]:
    ranks = []
    for rank in range(world):
        data = range(len(lengths))  # the sampler reads only the dataset's length when given lengths
        sampler = LengthGroupedSampler(data, batch, lengths, num_replicas=world, rank=rank, megabatch_mult=mult)
        sampler.set_epoch(epoch)
        ranks.append(list(sampler))
    return ranks


def tokens(ranks: list[list[list[int]]], lengths: list[int]) -> dict[str, int]:
    """Tokens of every rank's batches, each padded to its longest sample: ``padded``, ``real``, ``batches``, and
    ``step``, what the steps cost in a synchronous run (every rank waits for the step's costliest batch: the world
    size times its padded tokens, summed over steps)."""
    found = dict.fromkeys(("padded", "real", "batches", "step"), 0)
    for step in zip(*ranks):  # the k-th batch of every rank: one step (every rank has as many)
        costs = [len(b) * max(lengths[i] for i in b) for b in step]
        found["padded"] += sum(costs)
        found["real"] += sum(lengths[i] for b in step for i in b)
        found["batches"] += len(step)
        found["step"] += len(step) * max(costs)
    return found


def measure(lengths: list[int], world: int, batch: int, epochs: int, mult: int) -> dict[str, float]:
    """Both samplers' padding (per batch, and per step) and padded tokens per batch over ``epochs`` epochs."""
    result: dict[str, float] = {}
    for name, make in (
        ("random", lambda e: random_batches(len(lengths), world, batch, e)),
        ("grouped", lambda e: grouped_batches(lengths, world, batch, e, mult)),
    ):
        total = Counter()
        for epoch in range(epochs):
            total.update(tokens(make(epoch), lengths))
        result[f"{name}_padding"] = 1 - total["real"] / total["padded"]
        result[f"{name}_step_padding"] = 1 - total["real"] / total["step"]
        result[f"{name}_tokens_per_batch"] = total["padded"] / total["batches"]
        result[f"{name}_step_tokens"] = total["step"]
    result["tokens_per_batch_ratio"] = result["random_tokens_per_batch"] / result["grouped_tokens_per_batch"]
    result["step_tokens_ratio"] = result["random_step_tokens"] / result["grouped_step_tokens"]
    return result


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.padding", description=__doc__)
    parser.add_argument("--batch-sizes", type=_ints, default=[8, 32], help="per-rank batch sizes, comma-separated")
    parser.add_argument("--worlds", type=_ints, default=[2, 8], help="world sizes, comma-separated")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=512, help="truncation, in words")
    parser.add_argument("--megabatch-mult", type=int, default=50, help="LengthGroupedSampler's megabatch_mult")
    parser.add_argument("--max-files", type=int, default=None, help="only the first N modules (for a quick run)")
    parser.add_argument("--out", default="bench/results/padding.json")
    args = parser.parse_args(argv)
    files = stdlib_files(args.max_files)
    words = docstring_lengths(files)
    lengths = [min(n, args.max_length) for n in words]
    corpus = {
        "source": f"docstrings of the Python {sys.version.split()[0]} standard library ({len(files)} modules)",
        "samples": len(lengths),
        "words": sum(lengths),
        "median": statistics.median(lengths),
        "p90": sorted(lengths)[int(0.9 * (len(lengths) - 1))],
        "longest": max(words),
        "max_length": args.max_length,
        "truncated": sum(n > args.max_length for n in words),
    }
    print(
        f"{corpus['source']}: {corpus['samples']} samples, median {corpus['median']} words, "
        f"{corpus['truncated']} of them truncated at {args.max_length}"
    )
    runs = []
    for world in args.worlds:
        for batch in args.batch_sizes:
            m = measure(lengths, world, batch, args.epochs, args.megabatch_mult)
            runs.append({"world": world, "batch": batch, **m})
            print(
                f"world {world}, batch {batch}: padding {m['random_padding']:.1%} random, {m['grouped_padding']:.1%} "
                f"grouped (per step {m['random_step_padding']:.1%}, {m['grouped_step_padding']:.1%}); padded tokens "
                f"per batch {m['tokens_per_batch_ratio']:.2f}x fewer, per step {m['step_tokens_ratio']:.2f}x"
            )
    write_json(args.out, {"corpus": corpus, "epochs": args.epochs, "megabatch_mult": args.megabatch_mult, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
