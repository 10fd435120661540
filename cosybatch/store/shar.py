"""Lhotse Shar: the layout lhotse (`CutSet.from_shar`) and NeMo's Lhotse loader read sequentially
at scale, written from a job's items (`cosybatch export --to shar`, `run --export shar`):

    OUT/exports/shar/cuts.000000.jsonl.gz     one cut a line (a MonoCut: its recording and supervisions)
    OUT/exports/shar/recording.000000.tar     each cut's audio, KEY.flac (or KEY.opus), then KEY.json
    OUT/exports/shar/cuts.000001.jsonl.gz ... one pair per shard of the job

The format, as the Shar writers and readers of lhotse 1.x (`lhotse/shar/`) write and read it:
- A folder holds one set of files per field, `FIELD.NNNNNN.EXT`, the cuts' field being
  `cuts.NNNNNN.jsonl.gz`; `from_shar(in_dir=...)` groups the files by the name before the first
  dot and pairs shard N of every field with shard N of the cuts.
- Each line of `cuts.N.jsonl.gz` is a cut as lhotse serialises one (`"type": "MonoCut"`, `start`
  0, its `duration`, `channel` 0, its `supervisions`), whose `recording` has a single placeholder
  source, `{"type": "shar", "channels": [0], "source": ""}`.
- `recording.N.tar` holds two members per cut, in the order of the cuts' lines: the audio bytes,
  named CUT_ID.EXT, then CUT_ID.json, the cut's recording manifest (with the same placeholder) on
  one line. The reader zips the cuts with these pairs, checks that the data member's name less its
  extension is the cut's id, and fills the placeholder with the member's bytes as a `memory`
  source, which lhotse decodes from the bytes themselves (soundfile reads WAV, FLAC and Opus):
  the extension is for people.

The choices here:
- **One Shar shard per shard of the job**, numbered as the NeMo export numbers them (a sharded
  job's parts in order, then each part's shards): the job's shards already have the size their
  user chose (`--shard-max-items`, `--shard-max-mb`, 1000 items by default, as Shar's own default
  shard), shard N here holds exactly the items of the job's shard N, so a cut is traced to its
  shard by its number, and the export streams one shard at a time, one clip in memory. A job with
  no items gets one empty pair, so it still loads (as the Hugging Face export writes an empty file).
- **The audio**: a WAV member is stored as 16-bit FLAC, lossless (the very samples, about half the
  bytes, and lhotse's own default for Shar); a FLAC or Opus member is stored as its own
  bytes, never decoded and encoded again, so a lossy clip loses nothing more and decodes to
  exactly what its shard member decodes to. (A WAV member that is not 16-bit mono PCM, which
  cosybatch never writes, is stored as it is rather than narrowed.)
- **Cut and recording ids are the items' keys** (never a dot or a slash, so the reader's id check
  holds); the supervisions are the Lhotse export's (exports.py `lhotse_supervisions`: one per
  segment of KEY.json "segments", the item's id in each one's `custom["id"]`).

This module holds the layout only; exports.py reads and checks the shards, checks the folder
first and writes the export into place (`export(root, "shar")`). Lhotse is not imported: it is a
test dependency (tests/store/test_audio_exports.py loads the export with `CutSet.from_shar`).
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path

from .audio import DEFAULT_FORMAT, encode

CUTS = "cuts.{:06d}.jsonl.gz"
RECORDING = "recording.{:06d}.tar"

Item = tuple[str, dict, bytes, list[dict]]
"""(key, its KEY.json, its audio member's bytes, its Lhotse supervisions)"""


def write_shar(dest: Path, shards: Iterable[Iterable[Item]]) -> int:
    """Write each shard's items as cuts.N.jsonl.gz + recording.N.tar in the folder `dest`, N
    from 0 -> the number of shards written (one empty pair when there are none)."""
    count = 0
    for n, items in enumerate(shards):
        write_shard(dest, n, items)
        count = n + 1
    if count == 0:
        write_shard(dest, 0, ())
        count = 1
    return count


def write_shard(dest: Path, n: int, items: Iterable[Item]) -> None:
    """Shard N: the audio and recording members in recording.N.tar, then the cuts, in the same order."""
    cuts = []
    with open(dest / RECORDING.format(n), "xb") as f, tarfile.open(fileobj=f, mode="w",
                                                                   format=tarfile.USTAR_FORMAT) as tar:
        for key, meta, data, supervisions in items:
            ext, stored = stored_audio(meta.get("format", DEFAULT_FORMAT), data)
            recording = recording_of(key, meta)
            _add(tar, f"{key}.{ext}", stored)
            _add(tar, f"{key}.json", (json.dumps(recording) + "\n").encode())
            cuts.append({"id": key, "start": 0, "duration": recording["duration"], "channel": 0,
                         "supervisions": supervisions, "recording": recording, "type": "MonoCut"})
    lines = "".join(json.dumps(cut, ensure_ascii=False) + "\n" for cut in cuts).encode()
    (dest / CUTS.format(n)).write_bytes(gzip.compress(lines, mtime=0))


def recording_of(key: str, meta: dict) -> dict:
    """The cut's recording manifest, its source the Shar placeholder; rate and length as the item
    records them (what its member decodes to)."""
    rate, samples = meta["sample_rate"], meta["num_samples"]
    return {"id": key, "sources": [{"type": "shar", "channels": [0], "source": ""}], "sampling_rate": rate,
            "num_samples": samples, "duration": samples / rate, "channel_ids": [0]}


def stored_audio(fmt: str, data: bytes) -> tuple[str, bytes]:
    """(extension, bytes) of the audio as Shar stores it: a 16-bit mono WAV member as FLAC (the
    same samples), any other member as it is."""
    if fmt != "wav":
        return fmt, data
    import soundfile

    info = soundfile.info(io.BytesIO(data))
    if info.subtype != "PCM_16" or info.channels != 1:
        return fmt, data
    pcm, rate = soundfile.read(io.BytesIO(data), dtype="int16", always_2d=False)
    return "flac", encode(pcm, rate, "flac")


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)  # mtime 0, mode 0644, no owner: the same bytes from the same items
    member.size = len(data)
    tar.addfile(member, io.BytesIO(data))
