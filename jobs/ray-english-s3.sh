#!/bin/sh
# The English job on an existing Ray cluster whose nodes share no disk: the corpus is read from
# S3 and each actor uploads the shards it writes to S3 itself; the driver stages only the
# job's records. Every node needs the store's credentials (an instance role, or the AWS_*
# variables in the cluster's environment). See docs/production.md, "Object storage".
set -eu
exec cosybatch ray-run s3://speech-corpora/english/ --out "${OUT:-s3://speech-datasets/english-piper-ray}" \
  --address "${RAY_ADDRESS:-auto}" --actors "${ACTORS:-4}" --num-cpus 1 --rows-per-task 256
