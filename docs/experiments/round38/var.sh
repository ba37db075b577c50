#!/bin/bash
# (run from the root of a worktree with variants.patch applied and run37.py copied to experiments/round37/run.py)
# usage: var.sh TAG ENV... ; runs weka, mc-hc-150, synthetic-hc seeds 1-6 mode 3:host with SPILL_GW=2
tag=$1; shift
for w in weka mc-hc-150 synthetic-hc; do for s in 1 2 3 4 5 6; do
  env SPILL_GW=2 "$@" PYTHONPATH=. python experiments/round37/run.py $w $s 3:host | sed "s/\"mode\": \"3:host\"/\"mode\": \"$tag\"/"
done; done
