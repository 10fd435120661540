#!/bin/sh
# The English job on an existing Ray cluster (run on the head node, or anywhere with
# RAY_ADDRESS=ray://HEAD:10001). One actor per GPU on a GPU cluster: --actors N --num-gpus 1.
# A rerun resumes from the finished shards; see README "A Ray cluster".
set -eu
exec cosybatch ray-run --job jobs/english-piper-sharded.yaml --address "${RAY_ADDRESS:-auto}" \
  --actors "${ACTORS:-4}" --num-cpus 1 --rows-per-task 256
