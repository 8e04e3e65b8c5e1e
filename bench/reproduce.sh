#!/usr/bin/env bash
# The figures in README.md: every variant inside the same 2 processes, steps interleaved. Shaped links need root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p bench/results
# Every zoo model, loopback and 1 Gbit/s: identical settings (gradsync:tune=0 = torch's fixed default buckets, no
# extras) and gradsync's default (bucket sizes tuned at the rebuild).
for model in mlp gpt cnn tiny; do
  $PY -m bench --model "$model" --steps 30 --out "bench/results/$model-loopback.json" \
      --variants "local;torch;gradsync:tune=0;gradsync;gradsync:hook=noop;gradsync:hook=noop,static=1"
  $PY -m bench --model "$model" --variants "local;allreduce;torch;gradsync:tune=0;gradsync" --steps 15 --link 1gbit \
      --out "bench/results/$model-1gbit.json"
done
# What gradsync adds on the slow link: compression, no overlap (the paper's baseline), no_sync, memory, ZeRO,
# and the cost of the debugging and monitoring options.
$PY -m bench --model mlp --link 1gbit --steps 15 --out bench/results/mlp-1gbit-options.json --variants \
  "torch;gradsync;gradsync:hook=bf16;gradsync:hook=fp16;gradsync:overlap=0;gradsync:accum=2;gradsync:accum=4;gradsync:accum=8;gradsync:view=1;gradsync:monitor=1;gradsync:debug=1;gradsync:opt=adam;gradsync:opt=adam,zero=1"
$PY -m bench --model gpt --link 1gbit --steps 10 --out bench/results/gpt-1gbit-options.json --variants \
  "torch;gradsync;gradsync:hook=bf16;gradsync:overlap=0"
# Bucket size (the paper's bucket-size figure), on the slow link.
$PY -m bench --model mlp --link 1gbit --steps 12 --out bench/results/mlp-1gbit-buckets.json --variants \
  "torch;gradsync:cap=0.25;gradsync:cap=1;gradsync:cap=5;gradsync:cap=25;gradsync:cap=100"
# Optimizer steps overlapped with the remaining all-reduces (gradsync.optim.OverlappedOptimizer), Adam.
$PY -m bench --model mlp --link 1gbit --steps 15 --out bench/results/mlp-1gbit-overlap-opt.json --variants \
  "torch;gradsync:cap=5,opt=adam;gradsync:cap=5,opt=adam,overlap_opt=1;gradsync:cap=1,opt=adam;gradsync:cap=1,opt=adam,overlap_opt=1"
# Both at their defaults with Adam, and gradsync's OverlappedOptimizer on its tuned buckets.
$PY -m bench --model mlp --link 1gbit --steps 12 --out bench/results/mlp-1gbit-adam-defaults.json --variants \
  "torch:opt=adam;gradsync:opt=adam;gradsync:opt=adam,overlap_opt=1"
# Compiled training (README, "Compiled training"): compiled gradsync x compiled torch, both wrapping orders.
for order in inner outer; do
  $PY -m bench.repeat --runs 3 --models mlp,gpt,cnn --links loopback,1gbit --compile "$order" \
      --variants "local;torch;gradsync" --steps 10 --warmup 6 --out "bench/results/compiled-$order"
done
# The tuner's check (README, "Bucket sizes"), scaling (README, "Scaling"), sending less ("Sending less"),
# elastic recovery ("Surviving failures") and the bad-input sweep ("When something goes wrong").
$PY -m bench.repeat --runs 3 --models mlp,lnmlp,cnn,tiny --links loopback,1gbit --steps 20 --out bench/results/tuner/fast
for link in 10gbit 1gbit; do $PY -m bench.scale --model resnet50 --ranks 1,2,4,8,16 --link "$link"; done
$PY -m bench.paper_plan
METHODS=torch,int8,diloco32,diloco128,streaming32-p4-d2-int4
$PY -m bench.converge --link 50mbit --budget 80 --runs 3 --methods $METHODS --out bench/results/converge-lab
$PY -m bench.converge --link 400mbit --budget 40 --runs 3 --methods $METHODS --out bench/results/converge-lab
$PY -m bench.elastic_lab --runs 3
$PY -m bench.elastic_lab --runs 5 --etcd host
$PY -m bench.elastic_lab --runs 3 --etcd link
$PY -m bench.elastic_overhead --ranks 3 8 --runs 3 --store etcd
$PY -m bench.sweep --out bench/results/sweep.json
