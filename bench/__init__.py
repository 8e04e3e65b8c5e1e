"""Performance labs, one subpackage each; reproduce.sh runs every command behind README's figures.

    python -m bench                     sidebyside/: torch's DDP and gradsync variants in the same processes
    python -m bench.sidebyside.repeat   the same, several runs
    python -m bench.scale               scale/: many ranks over shaped hosts (with step_cpu, paper_plan)
    python -m bench.converge            converge/: time to torch's loss for methods that send less
    python -m bench.elastic.recovery    elastic/: pauses after a lost worker or host (and elastic.overhead)
    python -m bench.memory              memory/: peak host memory against torch's
    python -m bench.padding             padding/: the padding LengthGroupedSampler saves on real text

The plumbing (netlab, etcd, the result writer, the models) is lab/'s; results go to bench/results/.
"""
