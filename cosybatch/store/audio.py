"""The audio member of a shard item: the formats it may be written in, how each is encoded from
the clip's 16-bit samples and decoded back, and the sample rates and bitrates each accepts.

    wav   16-bit PCM WAV (the default)           any rate
    flac  16-bit FLAC, lossless                  any rate
    opus  Opus in Ogg, lossy, --bitrate kbit/s   8, 12, 16, 24 or 48 kHz (Opus's own rates)

The member is named by its format (`KEY.wav`, `KEY.flac`, `KEY.opus`); one item has exactly one.
All three are written and read by the libsndfile that soundfile bundles (1.2.2 here). A lossy clip
decodes to other samples than were encoded: the item records what its member decodes to, and the
quality gate judges that.

MP3 is not offered although that libsndfile writes it: its MP3 length is not the clip's. Measured
here on 62,499 samples at 22,050 Hz: at 64 and 96 kbit/s the member decodes to 62,499 samples,
at 32 and 48 kbit/s to 63,936 while its header says 64,235, so a manifest's sample count would
hold for one decoder and not another. Opus is the smaller lossy format for speech anyway.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class AudioFormat:
    name: str  # also the member's extension
    container: str  # soundfile's format
    subtype: str  # soundfile's subtype
    mime: str  # for the audit page's data: URIs and HTTP
    lossy: bool = False
    rates: Optional[tuple[int, ...]] = None  # the rates it can hold; None: any
    bitrates: Optional[tuple[int, int, int]] = None  # kbit/s: (default, lowest, highest)


FORMATS: dict[str, AudioFormat] = {
    "wav": AudioFormat("wav", "WAV", "PCM_16", "audio/wav"),
    "flac": AudioFormat("flac", "FLAC", "PCM_16", "audio/flac"),
    "opus": AudioFormat("opus", "OGG", "OPUS", "audio/ogg", lossy=True, rates=(8000, 12000, 16000, 24000, 48000),
                        bitrates=(32, 6, 256)),
}
AUDIO_EXTS = frozenset(FORMATS)
DEFAULT_FORMAT = "wav"

# libsndfile sets Opus's bitrate through its compression level (0 = best, 1 = smallest):
# level = (256 - kbit/s) / 250, so 6-256 kbit/s (measured: 32 asked, 31-32 kbit/s written at 16,
# 24 and 48 kHz; it is a variable bitrate, so one clip's own rate varies around it).


@dataclass(frozen=True)
class Member:
    """An item's audio as it goes into its shard: the member's extension (its format) and bytes, what
    they decode to (rate, sample count), and what the clip's last stage recorded of it (KEY.json
    fields: loudness, trimmed_s, resampled_from)."""

    ext: str
    data: bytes
    sample_rate: int
    num_samples: int
    fields: Optional[dict] = None


def get_format(name: str) -> AudioFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown audio format {name!r}; choose from {', '.join(FORMATS)}") from None


def coded_rate(fmt: str, rate: int) -> int:
    """The rate a clip of `rate` Hz is written at in `fmt`: `rate` itself where the format holds it,
    else the lowest rate it holds above `rate` (Opus: 22050 -> 24000), so nothing audible is lost."""
    rates = get_format(fmt).rates
    if rates is None or rate in rates:
        return rate
    above = [r for r in rates if r > rate]
    return above[0] if above else rates[-1]


def compression_level(kbps: float) -> float:
    """libsndfile's Opus compression level for `kbps` kbit/s."""
    return min(1.0, max(0.0, (256.0 - kbps) / 250.0))


def encode(pcm: np.ndarray, rate: int, fmt: str = DEFAULT_FORMAT, bitrate: Optional[float] = None) -> bytes:
    """16-bit samples (int16, mono) at `rate` Hz -> the member's bytes in `fmt`. `rate` must be one
    the format holds (`coded_rate`); `bitrate` (kbit/s) is for the lossy formats, their default
    when None."""
    f = get_format(fmt)
    if f.rates is not None and rate not in f.rates:
        raise ValueError(f"{fmt} cannot hold {rate} Hz audio (it holds {', '.join(map(str, f.rates))} Hz)")
    pcm = np.asarray(pcm)
    if pcm.dtype != np.int16:
        raise TypeError(f"encode takes int16 samples, got {pcm.dtype}")
    options = {}
    if f.lossy:
        options["compression_level"] = compression_level(bitrate or f.bitrates[0])
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, pcm, rate, format=f.container, subtype=f.subtype, **options)
    return buf.getvalue()


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """A member's bytes, any format above -> (float32 samples, mono, in [-1, 1]; rate)."""
    import soundfile

    audio, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=False)
    if audio.ndim > 1:  # written mono; a multichannel member would have been made by someone else
        audio = audio.mean(axis=1).astype(np.float32)
    return audio, rate


def audio_ext(name: str) -> Optional[str]:
    """The audio format of a member named KEY.EXT, or None when it is not an audio member."""
    ext = name.rpartition(".")[2]
    return ext if "." in name and ext in AUDIO_EXTS else None


def audio_member(tar, key: str):
    """KEY's audio member (KEY.wav, KEY.flac, ...) in an open tarfile.TarFile, or None. Readers
    split the key from the extension at the first dot."""
    return next((m for m in tar if m.name.partition(".")[0] == key and audio_ext(m.name)), None)


def mime_type(data: bytes) -> str:
    """The MIME type of an audio member's bytes, by their signature (the audit page's data: URIs)."""
    if data[:4] == b"fLaC":
        return FORMATS["flac"].mime
    if data[:4] == b"OggS":
        return FORMATS["opus"].mime
    return FORMATS["wav"].mime


def audio_of(members: dict):
    """An item's members by extension -> (ext, value) of its audio member, or None. Several audio
    members in one item is a damaged item: ValueError."""
    found = [(ext, value) for ext, value in members.items() if ext in AUDIO_EXTS]
    if len(found) > 1:
        raise ValueError(f"more than one audio member ({', '.join(ext for ext, _ in found)})")
    return found[0] if found else None


def checksum(data: bytes) -> str:
    """What the writer records of an audio member (KEY.json and the manifest's `wav_sha256`, whatever
    the format: the name predates the other formats) and what verify and the repair compare: hex sha256."""
    return hashlib.sha256(data).hexdigest()
