"""cosybatch: turn text corpora into speech datasets.

The data path is one straight line, the row line (``cosybatch.run.line.RowLine``), run by a job
(``cosybatch.run.job.Job``) through a runner (``cosybatch.run.runner.Runner``):
corpus -> admission -> prepare -> plan (lengths, buckets, batches) -> engine -> quality gate
-> shards + journal -> stats.
"""

__version__ = "0.1.0"
