"""The output folder: the checkpoint (fingerprint, journal, manifest), tar shards, repair on
resume, and the tools that read a finished or running job (verify, status, exports, merge)."""
