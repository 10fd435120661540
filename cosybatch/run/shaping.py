"""The clip's last stage before its shard: its sample rate, its silent ends, its level, and its
encoding. One function, `shape`, run on every take (retakes too) before the quality gate judges
it, so the gate hears what is committed:

    resample   to --sample-rate (soxr, high quality), or to the nearest rate the format holds
    trim       leading and trailing silence cut to at most --trim-silence ms, where the quality
               signals find speech (qc.signals.speech_frames: the same measurement)
    level      integrated loudness to --loudness LUFS (ITU-R BS.1770-4, pyloudnorm) under a
               --true-peak ceiling (4x oversampled); or, without --loudness, the peak to full scale
               (--normalize, the default)
    encode     16-bit samples -> the member's bytes (store.audio: wav, flac, opus); a lossy
               member is decoded again, and the decoded samples are the clip from then on
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..config import OutputConfig
from ..qc.signals import FRAME_S, speech_frames
from ..store.audio import Member, coded_rate, decode, encode, get_format
from ..store.shards import as_committed, committed_pcm

TRUE_PEAK_OVERSAMPLING = 4  # BS.1770-4 Annex 2: 4x is enough from 44.1 kHz down (more below)


@dataclass
class Shaped:
    """A take made ready for its shard."""

    audio: np.ndarray  # float32 as a reader decodes the member: what the gate judges
    member: Member  # what the shard gets
    cut_s: float = 0.0  # seconds cut from the start: piece times move back by this

    @property
    def rate(self) -> int:
        return self.member.sample_rate


def shape(audio: np.ndarray, rate: int, out: OutputConfig) -> Shaped:
    """A row's joined clip (float, at the engine's `rate`) -> its member and what it decodes to."""
    audio = np.asarray(audio, dtype=np.float32)
    record: dict = {}
    target = coded_rate(out.audio_format, out.sample_rate or rate)
    if target != rate:
        audio = resample(audio, rate, target)
        record["resampled_from"] = rate
    cut_s = 0.0
    if out.trim_silence_ms is not None:
        audio, (cut_s, tail_s) = trim(audio, target, out.trim_silence_ms / 1000.0)
        record["trimmed_s"] = [round(cut_s, 6), round(tail_s, 6)]  # 6 digits: whole samples at any rate
    if out.loudness is not None:
        audio, record["loudness"] = to_loudness(audio, target, out.loudness, out.true_peak)
    elif out.normalize:
        audio = peak_normalised(audio)
    fmt = get_format(out.audio_format)
    if not fmt.lossy:
        committed = as_committed(audio)
        data = encode(committed_pcm(committed), target, fmt.name)
    else:
        data = encode(committed_pcm(as_committed(audio)), target, fmt.name, out.bitrate)
        committed, _ = decode(data)
    return Shaped(committed, Member(fmt.name, data, target, len(committed), record), cut_s)


def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    import soxr

    return soxr.resample(audio, rate, target, quality="HQ").astype(np.float32)


def peak_normalised(audio: np.ndarray) -> np.ndarray:
    """Scaled to a full-scale peak (silence stays silence)."""
    peak = float(np.max(np.abs(audio))) if len(audio) else 0.0
    return audio / peak if peak > 1e-8 else np.zeros_like(audio)


def trim(audio: np.ndarray, rate: int, keep_s: float) -> tuple[np.ndarray, tuple[float, float]]:
    """Leading and trailing silence cut to at most `keep_s` seconds each -> (clip, (cut at the start,
    cut at the end) in seconds). Speech is where the quality signals find it (every frame within
    their threshold of the clip's loud frames, no bridging needed at the ends); a clip with no
    speech is left whole."""
    speech = speech_frames(audio, rate, bridge=False)
    found = np.flatnonzero(speech)
    if found.size == 0:
        return audio, (0.0, 0.0)
    hop = max(1, round(FRAME_S * rate))
    keep = round(keep_s * rate)
    start = max(0, int(found[0]) * hop - keep)
    end = min(len(audio), (int(found[-1]) + 1) * hop + keep)
    return audio[start:end], (start / rate, (len(audio) - end) / rate)


def loudness(audio: np.ndarray, rate: int) -> float:
    """Integrated loudness, LUFS (BS.1770-4 with its gates). A clip shorter than the standard's
    400 ms block is measured as one block of its own length. -inf for silence."""
    import pyloudnorm

    duration = len(audio) / rate
    if duration <= 0:
        return -math.inf
    meter = pyloudnorm.Meter(rate, block_size=min(0.400, duration))
    return float(meter.integrated_loudness(audio.astype(np.float64)))


def true_peak_db(audio: np.ndarray, rate: int) -> float:
    """The true peak, dBTP: the largest sample of the clip oversampled 4x (BS.1770-4 Annex 2)."""
    if not len(audio):
        return -math.inf
    up = resample(audio, rate, rate * TRUE_PEAK_OVERSAMPLING)
    peak = max(float(np.max(np.abs(up))), float(np.max(np.abs(audio))))
    return 20 * math.log10(peak) if peak > 0 else -math.inf


def to_loudness(audio: np.ndarray, rate: int, target_lufs: float, ceiling_db: float) -> tuple[np.ndarray, dict]:
    """The clip at `target_lufs`, unless its true peak would then pass `ceiling_db`: then as loud as the
    ceiling allows (quieter than the target; the record says by how much). -> (clip, KEY.json
    "loudness": lufs (as measured after), true_peak_db, gain_db, limited_by_peak)."""
    measured = loudness(audio, rate)
    if not math.isfinite(measured):  # silence: nothing to measure, nothing to scale
        return audio, {"lufs": None, "true_peak_db": None, "gain_db": 0.0, "limited_by_peak": False}
    gain = target_lufs - measured
    peak = true_peak_db(audio, rate)
    limited = math.isfinite(peak) and peak + gain > ceiling_db
    if limited:
        gain = ceiling_db - peak
    scaled = (audio * np.float32(10 ** (gain / 20))).astype(np.float32)
    # 16-bit samples cannot hold more than full scale; a ceiling at 0 dBTP can still leave a sample there.
    scaled = np.clip(scaled, -1.0, 32767 / 32768)
    return scaled, {"lufs": round(measured + gain, 3), "true_peak_db": round(peak + gain, 3),
                    "gain_db": round(gain, 3), "limited_by_peak": bool(limited)}


def shift_segments(segments: Optional[list], cut_s: float, duration_s: float) -> Optional[list]:
    """Piece times (`segment_times`) after `cut_s` seconds were cut from the start of the clip and it
    is `duration_s` long: moved back, and held within the clip."""
    if segments is None or (not cut_s and all(s["end"] <= duration_s for s in segments)):
        return segments
    return [{**s, "start": min(duration_s, max(0.0, s["start"] - cut_s)),
             "end": min(duration_s, max(0.0, s["end"] - cut_s))} for s in segments]
