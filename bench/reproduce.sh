#!/usr/bin/env bash
# Every figure in README.md and docs/: the commands written next to them, exactly as written there
# (tests/test_reproduce.py checks that each one appears here), plus the side-by-side runs behind the tables of
# docs/benchmarks.md. Each result file records its command line and commit (lab/results.py). Shaped links and
# namespaces need root; the whole script takes many hours on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
python() { "$PY" "$@"; }
mkdir -p bench/results

# Benchmarks (docs/benchmarks.md): every zoo model, loopback and 1 Gbit/s: identical settings (gradsync:tune=0 =
# torch's fixed default buckets, no extras) and gradsync's default (bucket sizes tuned at the rebuild).
for model in mlp gpt cnn tiny; do
  python -m bench --model "$model" --steps 30 --out "bench/results/$model-loopback.json" \
      --variants "local;torch;gradsync:tune=0;gradsync;gradsync:hook=noop;gradsync:hook=noop,static=1"
  python -m bench --model "$model" --variants "local;allreduce;torch;gradsync:tune=0;gradsync" --steps 15 --link 1gbit \
      --out "bench/results/$model-1gbit.json"
done
# What gradsync adds on the slow link: compression, no overlap (the paper's baseline), no_sync, memory, ZeRO,
# and the cost of the debugging and monitoring options.
python -m bench --model mlp --link 1gbit --steps 15 --out bench/results/mlp-1gbit-options.json --variants \
  "torch;gradsync;gradsync:hook=bf16;gradsync:hook=fp16;gradsync:overlap=0;gradsync:accum=2;gradsync:accum=4;gradsync:accum=8;gradsync:view=1;gradsync:monitor=1;gradsync:debug=1;gradsync:opt=adam;gradsync:opt=adam,zero=1"
python -m bench --model gpt --link 1gbit --steps 10 --out bench/results/gpt-1gbit-options.json --variants \
  "torch;gradsync;gradsync:hook=bf16;gradsync:overlap=0"
# Bucket size (the paper's bucket-size figure), on the slow link.
python -m bench --model mlp --link 1gbit --steps 12 --out bench/results/mlp-1gbit-buckets.json --variants \
  "torch;gradsync:cap=0.25;gradsync:cap=1;gradsync:cap=5;gradsync:cap=25;gradsync:cap=100"
# Optimizer steps overlapped with the remaining all-reduces (gradsync.optim.OverlappedOptimizer), Adam.
python -m bench --model mlp --link 1gbit --steps 15 --out bench/results/mlp-1gbit-overlap-opt.json --variants \
  "torch;gradsync:cap=5,opt=adam;gradsync:cap=5,opt=adam,overlap_opt=1;gradsync:cap=1,opt=adam;gradsync:cap=1,opt=adam,overlap_opt=1"
# Both at their defaults with Adam, and gradsync's OverlappedOptimizer on its tuned buckets.
python -m bench --model mlp --link 1gbit --steps 12 --out bench/results/mlp-1gbit-adam-defaults.json --variants \
  "torch:opt=adam;gradsync:opt=adam;gradsync:opt=adam,overlap_opt=1"

# Bucket sizes (docs/buckets.md): the tuner's check.
python -m bench.sidebyside.repeat --runs 3 --models mlp,lnmlp,cnn,tiny --links loopback,1gbit --steps 20 --out bench/results/tuner/fast

# Compiled training (docs/compiled.md): compiled gradsync x compiled torch, both wrapping orders; the GPT longer;
# eager training unchanged.
for order in inner outer; do python -m bench.sidebyside.repeat --runs 3 --models mlp,gpt,cnn --links loopback,1gbit --compile \
  $order --variants "local;torch;gradsync" --steps 10 --warmup 6 --out bench/results/compiled-$order; done
python -m bench.sidebyside.repeat --runs 5 --models gpt --links 1gbit --compile inner --variants "local;torch;gradsync" \
  --steps 20 --warmup 6 --out bench/results/compiled-inner-gpt-long
python -m bench.sidebyside.repeat --runs 3 --models mlp,gpt --links 1gbit --out bench/results/eager-recheck

# Memory (docs/migrating.md).
python -m bench.memory --runs 3
python -m bench.memory --runs 3 --mmap-threshold 65536 --out bench/results/memory-live.json
# Mixed precision (docs/migrating.md): mixed_precision= against autocast and float32 at CPU bf16.
python -m bench.mixed_precision --runs 3 --loss-runs 1

# Against the physical limit (docs/benchmarks.md): every step as a multiple of max(model alone, all-reduce alone).
python -m bench.sidebyside.repeat --runs 3 --models mlp,gpt,cnn --links 1gbit --variants "local;allreduce;torch;gradsync:tune=0;gradsync" --out bench/results/limit

# Hosts of several ranks (docs/benchmarks.md): the two-level all-reduce against torch's flat one.
python -m bench.hierarchical --hosts 2 --runs 3
python -m bench.hierarchical --hosts 4 --runs 3 --out bench/results/hierarchical-4hosts.json

# Data x tensor parallelism (docs/parallelism.md): torch's DDP against gradsync's over the same TP model, 2 hosts.
python -m bench.tensor_parallel --link 1gbit --runs 3

# Batches of similar length (docs/checkpoints.md): the padding LengthGroupedSampler saves on real text.
python -m bench.padding --batch-sizes 8,32 --worlds 2,8 --epochs 3

# Sending less (docs/sending-less.md): time to torch's loss, communication-bound, balanced, compute-bound.
python -m bench.converge --link 50mbit --budget 80 --runs 3 --methods torch,int8,diloco32,diloco128,streaming32-p4-d2-int4 --out bench/results/converge-lab
python -m bench.converge --link 400mbit --budget 40 --runs 3 --methods torch,int8,diloco32,diloco128,streaming32-p4-d2-int4 --out bench/results/converge-lab
python -m bench.converge --task gpt --link 1gbit --budget 60 --runs 1 --batch 32 --eval-every 6 --methods torch,gradsync,bf16,int8

# Scaling (docs/scaling.md): measured to 16 ranks, the reducer's CPU per step, the paper's setting planned.
python -m bench.scale --model resnet50 --ranks 1,2,4,8,16 --link 10gbit --scale 128 --slow-motion 4 --runs 3 --steps 16
python -m bench.scale --model resnet50 --ranks 1,2,4,8,16 --link 1gbit --scale 64 --runs 3 --steps 12
python -m bench.scale.step_cpu --steps 600
python -m bench.scale.step_cpu --steps 600 --model gpt2
python -m bench.scale.step_cpu --scale 1 --steps 20 --warmup 5 --apart
python -m bench.scale.step_cpu --scale 1 --steps 20 --warmup 5 --apart --model gpt2
python -m bench.scale.step_cpu --scale 1 --steps 20 --warmup 5 --apart --no-lending   # and --model gpt2
python -m bench.scale.step_profile --model gpt2
python -m bench.scale.copy_calls
python -m bench.scale.paper_plan

# Surviving failures (docs/elastic.md): the pauses, with the store on etcd, and what elastic costs per step.
python -m bench.elastic.recovery --runs 3
python -m bench.elastic.recovery --runs 3 --detected-by allreduce
python -m bench.elastic.recovery --runs 5 --etcd host
python -m bench.elastic.recovery --runs 3 --etcd link
python -m bench.elastic.recovery --runs 3 --during-regroup
python -m bench.elastic.recovery --runs 3 --during-regroup --gate-off
python -m bench.elastic.recovery --runs 3 --stuck
python -m bench.elastic.recovery --runs 3 --paused-host
python -m bench.elastic.recovery --runs 3 --straggler
python -m bench.elastic.overhead --ranks 3 8 16 --runs 3
python -m bench.elastic.overhead --ranks 3 8 --runs 3 --store etcd
# Under chaos (docs/elastic.md): the 8-host soak, and recovery against the number of ranks.
python -m bench.elastic.chaos --hosts 8 --budget 1000 --mean 2 --seed 1 --epochs 600
python -m bench.elastic.chaos --reread bench/results/chaos-1.json
python -m bench.elastic.chaos --hosts 8 --budget 700 --mean 2 --seed 2 --epochs 500 --kinds sigkill pair host sigstop
python -m bench.elastic.chaos --hosts 8 --budget 240 --mean 2 --seed 3 --epochs 220 --kinds host
python -m bench.elastic.chaos --hosts 8 --budget 240 --mean 3 --seed 4 --kinds sigkill host sigstop paused stuck
python -m bench.elastic.chaos --hosts 8 --budget 1000 --mean 2 --seed 5 --epochs 600
python -m bench.elastic.scale --ranks 4 8 16 --runs 2 --kind sigkill
# The job's store at 256 and 1,024 simulated ranks, TCPStore and 3 etcd members (docs/scaling.md).
python -m bench.store_load --ranks 256 1024 --store tcp etcd --hosts 8 --seconds 15 --phase-timeout 240
# What one request costs etcd: a beat's put and range, a lease keep-alive, over TLS as a user, a token.
python -m bench.store_load.request_cost --rate 1000 --seconds 10 --runs 3

# Conformance (docs/migrating.md, docs/errors.md): torch's own DDP tests, and the bad-input sweep.
python -m conformance.torch_suite --ddp both --start-method fork
python -m conformance.sweep
