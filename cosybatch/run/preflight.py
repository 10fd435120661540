"""What a run checks before anything is written or loaded, shared by `run`, `run --check`,
`run --plan-only` and `ray-run`: options, corpus format and columns, device, engine and voices,
the quality gate's ASR model. Also the corpus and the ASR model as a run opens them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

from ..config import RunConfig
from ..corpus import Columns, Corpus
from ..engines import engine_check
from ..errors import UsageError
from ..sources import PartedCorpus
from ..sources import open_corpus as open_source
from ..store.distributed import part_name

log = logging.getLogger("cosybatch")


def preflight(cfg: RunConfig, device: Optional[str] = None) -> tuple[dict, Optional[Path]]:
    """The engine, its voice and every voice a pool or the voice map names, checked on `device`
    (default: --device) without loading a model. Returns the engine's resolved settings and the
    ASR model folder `--qc asr` will load (None for the other modes)."""
    resolved = engine_check(cfg.engine_class(), cfg.engine.voice, cfg.engine_options_for(device))
    check_pool_voices(cfg, device)
    return resolved, check_qc(cfg)


def check(cfg: RunConfig) -> dict:
    """`run --check`: everything a run checks before its first batch, without loading a model:
    options, corpus format and columns, device, engine and voices. Returns the resolved settings."""
    corpus = open_corpus(cfg)
    configure_gpu_allocator(cfg)  # as a run does, before the device check may import torch
    check_device(cfg)
    resolved, model = preflight(cfg)
    return {"config": cfg.to_dict(), "corpus": {"format": corpus.format, "rows": corpus.num_rows},
            "voice": resolved.get("voice", resolved), **({"qc_asr_model": str(model)} if model else {})}


def part_config(cfg: RunConfig) -> RunConfig:
    """A sharded worker's config: each worker owns a self-contained folder OUT/part-I-of-N, which
    `cosybatch merge` presents as one, and its own metrics file."""
    if cfg.output.shard_count is None:
        return cfg
    part = part_name(cfg.output.shard_index, cfg.output.shard_count)
    metrics = cfg.ops.metrics_file
    if metrics is not None:  # workers sharing a volume must not overwrite each other's file
        metrics = metrics.with_name(f"{metrics.stem}.{part}{metrics.suffix}")
    if cfg.output.store is not None:  # the part's own prefix, staged in a folder of the job's staging
        return cfg.with_options(out=f"{cfg.output.store}/{part}", staging=cfg.output.folder / part,
                                metrics_file=metrics)
    return cfg.with_options(out=cfg.output.folder / part, metrics_file=metrics)


def check_device(cfg: RunConfig) -> None:
    """--device cuda on a machine where the engine cannot use CUDA is a usage error, for `run` and
    `run --check` alike, found before any folder is written or model loaded (the engine's own check
    would come later, at load). Engines say what runs them on a GPU (`Engine.gpu_runtime`)."""
    if cfg.engine.device != "cuda":
        return
    from ..gpu import cuda_problem

    cls = cfg.engine_class()
    runtime = cls.gpu_runtime or ("torch" if cls.needs_torch_allocator else None)
    problem = cuda_problem(runtime)
    if problem is not None:
        raise UsageError(f"--device cuda: no usable CUDA GPU for the {cls.name} engine here: {problem}. "
                         "`cosybatch doctor` shows the set-up; or use --device cpu")


def configure_gpu_allocator(cfg: RunConfig) -> None:
    """For engines that run torch on a GPU: its allocator is chosen before torch can start CUDA."""
    if cfg.engine_class().needs_torch_allocator and cfg.engine.device != "cpu":
        from ..gpu import configure_allocator

        note = configure_allocator()
        if note:
            log.warning(note)


def open_corpus(cfg: RunConfig) -> Union[Corpus, PartedCorpus]:
    """The job's corpus: one file, or the parts of a folder, a glob or a URI (cosybatch.sources)."""
    return open_source(cfg.input.corpus, Columns(
        id=cfg.input.id_col or "id", text=cfg.input.text_col, voice=cfg.input.voice_col or "voice",
        id_required=cfg.input.id_col is not None, voice_required=cfg.input.voice_col is not None,
        # An engine may read another column as the voice when there is no voice column.
        voice_fallback=cfg.engine_class().voice_column_fallback), cfg.input.format, max_chars=cfg.input.max_chars)


def check_pool_voices(cfg: RunConfig, device: Optional[str] = None) -> None:
    """Every voice a pool or the voice map names, checked as --voice is (an engine with one instance
    per voice: a multi-voice engine's rows fail one by one, with the reason, on a voice it lacks),
    and each VOICE#SPEAKER entry against the speakers the voice's check reports (``speakers``,
    ``speaker_names``), where it reports them: a usage error naming the entry."""
    cls = cfg.engine_class()
    if cls.multi_voice:
        return
    entries = (*cfg.engine.voice_pool, *(e for pool in cfg.engine.voice_map.values() for e in pool))
    resolved = {}
    for voice in sorted({e.voice for e in entries if e.voice is not None}):
        resolved[voice] = engine_check(cls, voice, cfg.engine_options_for(device))
    spoken = [e for e in entries if e.speaker is not None]
    if spoken and any(e.voice is None for e in spoken):
        resolved[None] = engine_check(cls, cfg.engine.voice, cfg.engine_options_for(device))
    for entry in spoken:
        found = resolved[entry.voice]
        count, names = found.get("speakers"), found.get("speaker_names") or []
        if not isinstance(count, int):
            continue  # the engine does not say
        shown = f"{entry.voice or ''}#{entry.speaker}"
        voice = found.get("voice", entry.voice or cfg.engine.voice)
        if count <= 1:
            raise UsageError(f"--voice-pool entry {shown!r}: voice {voice!r} has one speaker; drop the #SPEAKER "
                             "entries or name a multi-speaker voice")
        if entry.speaker in names:
            continue
        if not entry.speaker.isdigit() or int(entry.speaker) >= count:
            raise UsageError(f"--voice-pool entry {shown!r}: voice {voice!r} has speakers 0..{count - 1}"
                             + (f" ({', '.join(names[:10])}{', ...' if len(names) > 10 else ''})" if names else "")
                             + "; name one of them")


def check_qc(cfg: RunConfig) -> Optional[Path]:
    """The ASR model folder `--qc asr` will load (None for the other modes); a usage error, before
    anything is written, when it or the runtime to run it is missing."""
    if cfg.qc_settings().mode != "asr":
        return None
    from ..qc.asr import ready_model

    return ready_model(cfg.quality.asr_model)


def open_transcriber(cfg: RunConfig, model: Optional[Path], device: str):
    """The ASR model on the engine's device (CUDA when the engine runs there and CTranslate2 has
    CUDA), or None when the gate does not transcribe."""
    if model is None:
        return None
    import ctranslate2

    from ..qc.asr import Transcriber

    where = "cpu"
    if device == "cuda":
        if ctranslate2.get_cuda_device_count() > 0:
            where = "cuda"
        else:
            log.warning("the engine runs on CUDA but CTranslate2 sees no CUDA device: the ASR runs on the CPU")
    return Transcriber(model, where, threads=max(1, cfg.engine.threads))
