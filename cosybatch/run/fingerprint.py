"""A job's fingerprint: everything that changes the audio or which rows are read, recorded in
the output folder when the job starts; a resume must match it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..config import RunConfig
from ..corpus import Corpus
from ..store.checkpoint import OutputDir, file_fingerprint, json_bytes, write_atomic

log = logging.getLogger("cosybatch")


def job_fingerprint(cfg: RunConfig, corpus: Corpus, engine: dict, runner: Optional[str] = None,
                    asr_model: Optional[Path] = None) -> dict:
    """Everything that changes the audio or which rows are read: a resume must match it. `engine`
    is the engine's fingerprint(), the device included (CPU and CUDA audio differ). A quality gate
    that retries or drops rows is part of it (its mode, limits and the ASR model's hash); the
    signals alone change no audio and are not."""
    from ..cache import file_sha256

    qc = cfg.qc_settings().fingerprint(file_sha256(asr_model / "model.bin") if asr_model else None)
    return {
        **({"qc": qc} if qc else {}),
        **({"runner": runner} if runner else {}),
        "corpus": corpus.fingerprint(),
        "columns": {"id": cfg.input.id_col, "text": cfg.input.text_col, "voice": cfg.input.voice_col,
                    "format": corpus.format},
        "engine": engine,
        "seed": cfg.engine.seed,
        "sentence_silence": cfg.output.sentence_silence_s,
        "normalize": cfg.output.normalize,
        **({"audio": audio} if (audio := cfg.output.audio_settings()) else {}),
        "shard": None if cfg.output.shard_count is None else [cfg.output.shard_index, cfg.output.shard_count],
        **({"voices": voices} if (voices := cfg.voice_router().describe()) else {}),
    }


def adopt_legacy_fingerprint(out: OutputDir, cfg: RunConfig, corpus: Corpus, fingerprint: dict) -> None:
    """Jobs started by an older cosybatch recorded a hash of the corpus's first and last MiB only,
    no device and no corpus format. Where what was recorded still matches, the record is brought
    up to date, so an upgrade never asks for --allow-corpus-change or --restart."""
    recorded = out.recorded() if not cfg.output.restart else None
    if recorded is None:
        return
    old = recorded.get("fingerprint", {})
    changed = []
    was = old.get("corpus") or {}
    if "sha256_head_tail" in was and isinstance(corpus, Corpus) and \
            was == {"name": corpus.path.name, **file_fingerprint(corpus.path)}:
        old["corpus"] = fingerprint["corpus"]
        changed.append("the corpus fingerprint now covers the whole file")
    for part, key in (("engine", "device"), ("columns", "format")):
        have, new = old.get(part) or {}, fingerprint[part]
        if key not in have and have == {k: v for k, v in new.items() if k != key}:
            old[part] = new
            changed.append(f"{part}.{key} ({new[key]}) is recorded from now on")
    if changed:
        write_atomic(out.job_file, json_bytes(recorded))
        log.info("%s: %s", cfg.output.folder, "; ".join(changed))
