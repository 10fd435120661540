"""cosybatch: turn text corpora into speech datasets.

The data path is one straight line (see ``cosybatch.run.job.Job``):
corpus -> plan (lengths, buckets, batches) -> engine -> shards + journal -> stats.
"""

__version__ = "0.1.0"
