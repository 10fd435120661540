#!/bin/sh
# Nightly cron slot for the English Piper job. Each run resumes where the last one stopped, so the
# same line can run every night until the corpus is done. flock keeps two slots from overlapping
# (cosybatch also refuses a second writer on one output folder); --max-runtime ends the run
# cleanly (exit 4, resumable) before the slot closes. POSIX sh: cron's /bin/sh (dash) runs it.
#
#   crontab:  0 1 * * *  cd /opt/cosybatch && sh jobs/cron-english.sh >> /var/log/cosybatch-english.log 2>&1
#
# Exit codes: 0 complete, 4 interrupted (resumable), other codes as in `cosybatch run --help`;
# 75 (EX_TEMPFAIL) when the previous slot still runs: this slot did nothing, the next one resumes.
set -eu
LOCK="${COSYBATCH_CRON_LOCK:-/tmp/cosybatch-english.lock}"
BUSY=75

# The lock is taken on a descriptor that cosybatch inherits through exec: it is held exactly as
# long as the run, and released even if the run is killed.
exec 9>>"$LOCK"
status=0
flock --nonblock --conflict-exit-code "$BUSY" 9 || status=$?
if [ "$status" -ne 0 ]; then
  if [ "$status" -eq "$BUSY" ]; then
    echo "$(date '+%Y-%m-%d %H:%M:%S') cron-english: the previous slot still holds $LOCK; skipped (exit $BUSY)" >&2
  fi
  exit "$status"
fi
exec cosybatch run --job jobs/english-piper.toml --max-runtime 5h
