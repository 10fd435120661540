"""Running a job: `job.py` is one job's life (open, fingerprint, resume, limits, signals, finish)
for both runners; `local.py` (`cosybatch run`) and `ray.py` (`cosybatch ray-run`) only dispatch
batches and commit them."""
