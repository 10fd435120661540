#!/usr/bin/env bash
# Nightly cron slot for an English Piper job. Reruns resume where the last run stopped, so the
# same line can run every night until the corpus is done; flock keeps two slots from overlapping
# (cosybatch also refuses a second writer on one output folder).
#
#   crontab:  0 1 * * *  /opt/cosybatch/jobs/cron-english.sh >> /var/log/cosybatch-english.log 2>&1
#
# Exit codes: 0 complete, 4 interrupted (resumable), others see `cosybatch run --help`.
set -euo pipefail
CORPUS=${CORPUS:-/data/corpora/english.parquet}
OUT=${OUT:-/data/speech/english-joe}
exec flock --nonblock /tmp/cosybatch-english.lock \
  cosybatch run "$CORPUS" --out "$OUT" --progress log --log-every 60
