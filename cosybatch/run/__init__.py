"""Running a job: `line.py` is the row line (admit, prepare, plan, synthesise, judge, render), written
once; `job.py` is one job's life (claim, fingerprint, resume, statistics, limits, signals, the end);
`runner.py` the contract between them, which `local.py` (`cosybatch run`, threads) and `ray.py`
(`cosybatch ray-run`, an actor pool) implement; `forecast.py` is `run --plan-only`."""
