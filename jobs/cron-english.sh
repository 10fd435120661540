#!/usr/bin/env bash
# Nightly cron slot for the English Piper job. Each run resumes where the last one stopped, so the
# same line can run every night until the corpus is done. flock keeps two slots from overlapping
# (cosybatch also refuses a second writer on one output folder); --max-runtime ends the run
# cleanly (exit 4, resumable) before the slot closes.
#
#   crontab:  0 1 * * *  cd /opt/cosybatch && jobs/cron-english.sh >> /var/log/cosybatch-english.log 2>&1
#
# Exit codes: 0 complete, 4 interrupted (resumable); see `cosybatch run --help`.
set -euo pipefail
exec flock --nonblock /tmp/cosybatch-english.lock \
  cosybatch run --job jobs/english-piper.toml --max-runtime 5h
