"""Kept only for the engines that still import their file hashes from here; the output folder's
checkpoint is `cosybatch.store.checkpoint`, and these hashes live in `cosybatch.cache`. Remove
once `engines/` and `piper_quant` import from `cosybatch.cache`."""

from .cache import file_fingerprint, file_sha256

__all__ = ["file_fingerprint", "file_sha256"]
