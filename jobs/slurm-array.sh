#!/bin/sh
# SLURM array: 4 workers, each takes its share of the ids from SLURM_ARRAY_TASK_ID.
#   sbatch jobs/slurm-array.sh        then, when all are done:  cosybatch merge out/english-piper-sharded
#SBATCH --job-name=cosybatch-english
#SBATCH --array=0-3
#SBATCH --cpus-per-task=2
#SBATCH --time=08:00:00
#SBATCH --requeue
#SBATCH --signal=B:TERM@120
set -eu
exec cosybatch run --job jobs/english-piper-sharded.yaml --shard 4 --max-runtime 7h50m
