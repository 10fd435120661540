"""Reading a cosybatch output folder back the way a user would."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import soundfile


def read_output(out: Path) -> dict[str, dict]:
    """id -> {meta, audio, sample_rate, shard}; fails if any id appears twice or a member is broken."""
    items: dict[str, dict] = {}
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        keys = sorted({name.split(".", 1)[0] for name in members})
        for key in keys:
            meta = json.loads(members[f"{key}.json"])
            audio, sr = soundfile.read(io.BytesIO(members[f"{key}.wav"]), dtype="float32")
            assert meta["id"] not in items, f"id {meta['id']!r} written twice"
            items[meta["id"]] = {"meta": meta, "audio": audio, "sample_rate": sr, "shard": shard.name, "key": key}
    return items
