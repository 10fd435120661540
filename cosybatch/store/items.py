"""The item format: what one finished clip becomes in a shard. Its key, its tar members (its audio,
KEY.wav or another format's KEY.EXT (store/audio.py), and KEY.json) and its manifest record, the
source hash that ties it to its corpus row, and the quality gate's manifest columns. The store
writes and reads items in this format; the run makes them; nothing here runs an engine or a
quality check."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from .. import __version__
from ..corpus import Row
from .audio import DEFAULT_FORMAT, Member, checksum
from .shards import item_key


def render_item(row: Row, text: str, audio: Member, engine: Any, cfg: Any,
                voice: Optional[str] = None, instruct: Optional[str] = None,
                qc: Optional[dict] = None, extra: Optional[dict] = None,
                segments: Optional[list] = None) -> tuple[str, dict, dict]:
    """A finished row's audio member (`store.audio.Member`, made by the run's last stage) -> (shard
    key, tar members {ext: bytes}, manifest record). `engine` is the engine that made it (its
    name, voice and fingerprint are recorded) and `cfg` the run's config (its seed,
    --sentence-silence, --normalize and the audio settings, `OutputConfig.audio_settings`). `voice`
    is the row's own voice when the engine serves several (fixed when the row was prepared); `qc`
    is the quality gate's record of it (KEY.json "qc"); `extra` the row's speaker, prompt and
    language (KEY.json fields and manifest columns of the same names) and its drawn settings
    (KEY.json "prosody"); `segments` where each piece is in the clip (KEY.json "segments")."""
    key = item_key(row.id)
    voice = voice or engine.voice_name
    settings = {**engine.fingerprint(), "sentence_silence": cfg.output.sentence_silence_s,
                "normalize": cfg.output.normalize, "cosybatch": __version__}
    if audio_settings := cfg.output.audio_settings():
        settings["audio"] = audio_settings
    meta = {
        "id": row.id, "text": text, "duration": audio.num_samples / audio.sample_rate,
        "sample_rate": audio.sample_rate, "num_samples": audio.num_samples, "voice": voice,
        "engine": engine.name, "seed": cfg.engine.seed, "row": row.index, "settings": settings,
    }
    if instruct is not None:
        meta["instruct"] = instruct
    extra = extra or {}
    for name in RECORDED:
        if extra.get(name) is not None:
            meta[name] = extra[name]
    if extra.get("prosody"):
        meta["prosody"] = extra["prosody"]
    if text != row.text:
        meta["source_text"] = row.text
    if qc is not None:
        meta["qc"] = qc
    if segments is not None:
        meta["segments"] = segments
    meta.update(audio.fields or {})
    # What the audio was, so that verify (and a repair that re-reads it) can tell when it changed;
    # the source hash, so that a repair adopts the item only for the same row.
    meta["format"] = audio.ext
    meta["wav_sha256"] = checksum(audio.data)
    meta["source"] = source_hash(row)
    members = {audio.ext: audio.data, "json": json.dumps(meta, ensure_ascii=False).encode()}
    record = {"id": row.id, "key": key, "row": row.index, "text": text, "voice": voice,
              "duration_s": meta["duration"], "num_samples": audio.num_samples, "sample_rate": audio.sample_rate,
              "source": meta["source"], "wav_sha256": meta["wav_sha256"]}
    if audio.ext != DEFAULT_FORMAT:
        record["format"] = audio.ext
    if (meta.get("loudness") or {}).get("lufs") is not None:
        record["loudness_lufs"] = meta["loudness"]["lufs"]
    if instruct is not None:
        record["instruct"] = instruct
    for name in RECORDED:
        if name in meta:
            record[name] = meta[name]
    if qc is not None:
        record.update(qc_columns(qc))
    return key, members, record

RECORDED = ("speaker", "prompt", "language")  # KEY.json fields that are manifest columns too, when set

def source_hash(row: Row) -> str:
    """What a row asked for (text, voice, prompt): a later corpus whose row differs is reported."""
    fields = [row.text, row.voice, row.prompt_wav, row.prompt_text]
    if row.instruct is not None or row.language is not None:  # only then: earlier hashes stay valid
        fields.append(row.instruct)
    if row.language is not None:
        fields.append(row.language)
    fields = json.dumps(fields, ensure_ascii=False)
    return hashlib.blake2b(fields.encode(), digest_size=8).hexdigest()

# The manifest's QC columns (store/checkpoint.py OPTIONAL_MANIFEST_COLUMNS), from a KEY.json "qc".
QC_COLUMNS = (("qc_pass", "bool_"), ("qc_flags", "string"), ("qc_score", "float64"), ("qc_cer", "float64"),
              ("qc_wer", "float64"), ("qc_attempts", "int32"), ("qc_z", "float64"),
              ("qc_speech_share", "float64"), ("qc_s_per_unit", "float64"), ("qc_asr_text", "string"),
              ("qc_pace", "float64"), ("qc_support", "float64"))

def qc_columns(qc: dict) -> dict:
    """A clip's QC record -> its manifest columns (flags comma-separated)."""
    asr = qc.get("asr") or {}
    signals = qc.get("signals") or {}
    return {"qc_pass": qc.get("pass"), "qc_flags": ",".join(qc.get("flags", ())), "qc_score": qc.get("score"),
            "qc_cer": asr.get("cer"), "qc_wer": asr.get("wer"), "qc_attempts": len(qc.get("attempts", ())) or 1,
            "qc_z": qc.get("z"), "qc_speech_share": signals.get("speech_share"),
            "qc_s_per_unit": signals.get("s_per_unit"), "qc_asr_text": asr.get("text"),
            "qc_pace": signals.get("pace"), "qc_support": asr.get("support")}
