"""OUT/README.md: a Hugging Face dataset card for the folder, written at the end of a complete run
and by `merge` and `export` (a sharded job's root gets one for the whole job).

It is the documented format (https://huggingface.co/docs/hub/datasets-cards): a YAML header
between `---` lines (license, language, size category, task categories, tags), then Markdown.
It is written with pyyaml, a runtime dependency, rather than `huggingface_hub`'s card classes,
which cosybatch does not otherwise need; the tests load it with `huggingface_hub.DatasetCard`.

The card says what made the audio (engine, voice or model and its sha256, cosybatch version,
settings), the rows and hours per voice (and language, where the manifest has a language
column), the quality gate's summary when it ran, and that the audio is synthetic. A README.md
cosybatch did not write (it lacks MARKER) is never overwritten: the card is skipped with a
warning. Nor is a README.md that is a symbolic link, a FIFO, a device or larger than CARD_CAP: it
is not read (see readback.py) and left as it is, with a warning. The license is "unknown" until
the user sets it in the card's header; a rewrite keeps the license of the card it replaces, read
from its YAML front matter (the lines between a first line `---` and the next line that is
exactly `---`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

from .checkpoint import MANIFEST_FILE, STATS_FILE, OutputDir, write_atomic
from .distributed import output_dirs
from .readback import CARD_CAP, NotReadable, open_regular, read_json, read_regular

log = logging.getLogger("cosybatch")

CARD_FILE = "README.md"
MARKER = ("<!-- cosybatch: this card is written by cosybatch (run, merge, export) and rewritten each "
          "time; delete this line to keep your own edits -->")
SIZE_CATEGORIES = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
                   (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B"))
SHOWN_ELSEWHERE = ("engine", "voice", "device", "model_sha256")  # engine fingerprint keys the card names itself


def size_category(rows: int) -> str:
    """The Hub's size_categories value for a number of rows."""
    for bound, name in SIZE_CATEGORIES:
        if rows < bound:
            return name
    return "n>1B"


def write_card(root: Path) -> Optional[Path]:
    """Write ROOT/README.md (None when ROOT holds no job, or a README.md of the user's is there).
    Never raises: the card describes the data and must not fail the run, merge or export."""
    root = Path(root)
    path = root / CARD_FILE
    try:
        try:
            earlier = read_regular(path, CARD_CAP).decode("utf-8", "replace") if os.path.lexists(path) else None
        except NotReadable as exc:  # a link, a FIFO, a device, a huge file: not ours, and not read
            log.warning("%s; left as it is (no dataset card written)", exc)
            return None
        if earlier is not None and MARKER not in earlier:
            log.warning("%s was not written by cosybatch; left as it is (no dataset card written)", path)
            return None
        text = card_text(root, license=_license_of(earlier))
        if text is None:
            return None
        write_atomic(path, text.encode("utf-8"))
        return path
    except Exception as exc:
        log.warning("could not write the dataset card %s: %s", path, exc)
        return None


def front_matter(card: str) -> Optional[dict]:
    """The YAML header of a card: the lines between a first line that is `---` and the next line
    that is exactly `---`, loaded with yaml's safe loader (None when there is none, or it is not a
    YAML mapping). Not a split on `---`: a value (the folder's name in pretty_name) may hold one."""
    import yaml

    lines = card.splitlines()
    if not lines or lines[0].rstrip() != "---":
        return None
    try:
        end = lines.index("---", 1)
    except ValueError:
        return None
    try:
        header = yaml.safe_load("\n".join(lines[1:end]))
    except yaml.YAMLError:
        return None
    return header if isinstance(header, dict) else None


def _license_of(card: Optional[str]) -> str:
    """The license in the header of the card being replaced (the user may have set it), else unknown."""
    value = (front_matter(card) or {}).get("license") if card else None
    if isinstance(value, str) and value.strip():
        return value.strip()
    return "unknown"


def _manifest_rows(root: Path, folders: list[Path]) -> list[dict]:
    """voice, duration_s and (when present) language of every committed row: ROOT's manifest (a
    single folder's, or the one `merge` wrote), else the parts' own."""
    import pyarrow.parquet as pq

    sources = [root / MANIFEST_FILE] if os.path.lexists(root / MANIFEST_FILE) else [f / MANIFEST_FILE for f in folders]
    rows = []
    for source in sources:
        if not os.path.lexists(source):
            continue
        with open_regular(source) as f:  # a link or a FIFO is refused (NotReadable), not read
            manifest = pq.ParquetFile(f)
            columns = [c for c in ("voice", "duration_s", "language") if c in manifest.schema_arrow.names]
            rows += manifest.read(columns=columns).to_pylist()
    return rows


def _sum_qc(summaries: list[dict]) -> Optional[dict]:
    """The parts' stats.json "qc" blocks as one: counts summed, a mean kept only when one part has it."""
    summaries = [s for s in summaries if isinstance(s, dict) and s]
    if len(summaries) <= 1:
        return summaries[0] if summaries else None

    def add(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return a + b
        return a if a == b else None

    total = summaries[0]
    for s in summaries[1:]:
        total = add(total, s)
    return {k: v for k, v in total.items() if not k.endswith("_mean")}


def card_text(root: Path, license: str = "unknown") -> Optional[str]:
    """The card's text for ROOT (a job folder or a sharded job's root), or None when it holds no job."""
    import yaml

    root = Path(root)
    folders = output_dirs(root)
    if not folders:
        return None
    stats = read_json(root / STATS_FILE)
    part_stats = [read_json(f / STATS_FILE) for f in folders]
    first = next((s for s in part_stats if s.get("engine")), {})
    recorded = read_json(OutputDir(folders[0]).job_file)
    fingerprint = recorded.get("fingerprint") or {}
    engine = fingerprint.get("engine") or {}
    rows = _manifest_rows(root, folders)
    total_s = sum(r.get("duration_s") or 0.0 for r in rows)
    has_language = any(r.get("language") for r in rows)
    languages = sorted({r["language"] for r in rows if r.get("language")}) if has_language else (
        [first["language"]] if first.get("language") else [])
    qc = stats.get("qc") if isinstance(stats.get("qc"), dict) else _sum_qc([s.get("qc") for s in part_stats])

    header = {"license": license}
    if languages:
        header["language"] = languages
    header.update({
        "pretty_name": root.resolve().name,
        "size_categories": [size_category(len(rows))],
        "task_categories": ["text-to-speech", "automatic-speech-recognition"],
        "tags": ["synthetic", "tts", "cosybatch", *([engine["engine"]] if engine.get("engine") else [])],
    })
    if (root / "exports" / "hf" / "data").is_dir():  # the Hub's viewer loads the HF export
        header["configs"] = [{"config_name": "default",
                              "data_files": [{"split": "train", "path": "exports/hf/data/*.parquet"}]}]

    name = engine.get("engine") or first.get("engine") or "an unknown engine"
    voice = engine.get("voice") or first.get("voice")
    lines = ["---", yaml.safe_dump(header, sort_keys=False, allow_unicode=True).rstrip(), "---", MARKER, "",
             f"# {root.resolve().name}", "",
             f"**The audio in this dataset is synthetic.** Every clip was generated by a text-to-speech model "
             f"({name}{f', voice {voice}' if voice else ''}) from text, with cosybatch; none is a recording of a "
             "person speaking. The text of each clip is the text it was generated from, not a transcript of it.",
             "", "## How it was made", "", "| | |", "|---|---|", f"| engine | {name} |"]
    if voice:
        lines.append(f"| voice or model | {voice} |")
    if engine.get("model_sha256"):
        lines.append(f"| model sha256 | `{engine['model_sha256']}` |")
    if engine.get("device") or first.get("device"):
        lines.append(f"| device | {engine.get('device') or first.get('device')} |")
    versions = sorted({s["cosybatch"] for s in part_stats if s.get("cosybatch")})
    if versions:
        lines.append(f"| cosybatch | {', '.join(versions)} |")
    corpus = fingerprint.get("corpus") or {}
    if corpus.get("name"):
        parts = corpus.get("parts")
        lines.append(f"| corpus | {corpus['name']}" + (f" (sha256 `{corpus['sha256']}`)" if corpus.get("sha256")
                                                        else f" ({len(parts)} parts)" if isinstance(parts, dict)
                                                        else "") + " |")
    settings = {k: v for k, v in engine.items() if k not in SHOWN_ELSEWHERE}
    settings.update({k: fingerprint[k] for k in ("seed", "sentence_silence", "normalize") if k in fingerprint})
    if isinstance(fingerprint.get("qc"), dict):
        settings["qc"] = fingerprint["qc"]
    if fingerprint.get("shard"):
        settings["--shard workers"] = fingerprint["shard"][1]
    for key, value in settings.items():
        lines.append(f"| {key} | {json.dumps(value) if isinstance(value, (dict, list)) else value} |")

    failed = stats.get("failed", (stats.get("job_totals") or {}).get("items_failed"))
    lines += ["", "## Contents", "",
              f"{len(rows)} clips, {total_s / 3600:.3f} hours of audio"
              + (f", from {len(folders)} workers' folders" if len(folders) > 1 else "") + "."
              + (f" {failed} rows failed (failures.jsonl)." if failed else ""), ""]
    if stats.get("status") == "partial":  # `merge --partial`
        lines[-1:-1] = ["**This is a partial merge**: " + "; ".join(stats.get("problems") or ["some parts are missing"])
                        + ".", ""]
    lines += _table(rows, has_language, languages)
    if qc:
        lines += ["", "## Quality checks", "", _qc_sentence(qc), "", "```json",
                  json.dumps(qc, indent=2, sort_keys=True), "```"]
    lines += ["", "## Files", "",
              f"- `shard-NNNNNN.tar`: WebDataset shards, {_audio_member(fingerprint)} and `KEY.json` (the text, "
              "the voice, the seed and settings, the quality signals) per clip"
              + (" (in each `part-*` folder)" if len(folders) > 1 or folders[0] != root else "") + ".",
              "- `manifest.parquet`: one row per clip (id, shard, text, voice, duration_s, ..., qc_*).",
              "- `stats.json`: throughput and timing; `failures.jsonl`: rows that could not be made, with reasons."]
    exports = [(f, p) for f, p in (("Hugging Face Parquet", "exports/hf"), ("NeMo", "exports/nemo"),
                                   ("Lhotse", "exports/lhotse"), ("Lhotse Shar", "exports/shar"))
               if (root / p).is_dir()]
    for what, where in exports:
        lines.append(f"- `{where}/`: the {what} export.")
    return "\n".join(lines) + "\n"


AUDIO_MEMBERS = {"wav": "16-bit PCM mono", "flac": "16-bit FLAC mono, lossless", "opus": "Opus in Ogg, mono"}


def _audio_member(fingerprint: dict) -> str:
    """The shards' audio member as the job's fingerprint records its format (store/audio.py)."""
    audio = fingerprint.get("audio") if isinstance(fingerprint.get("audio"), dict) else {}
    fmt = audio.get("format") if audio.get("format") in AUDIO_MEMBERS else "wav"
    what = AUDIO_MEMBERS[fmt]
    bitrate, rate = audio.get("bitrate"), audio.get("sample_rate")  # a hand-edited job.json may hold anything
    if isinstance(bitrate, (int, float)) and not isinstance(bitrate, bool):
        what += f", {bitrate:g} kbit/s"
    if isinstance(rate, int) and not isinstance(rate, bool):
        what += f", {rate} Hz"
    return f"`KEY.{fmt}` ({what})"


def _table(rows: Iterable[dict], has_language: bool, languages: list[str]) -> list[str]:
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        key = (r.get("voice") or "", (r.get("language") or "") if has_language else "")
        entry = groups.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += r.get("duration_s") or 0.0
    if has_language:
        out = ["| voice | language | rows | hours |", "|---|---|---:|---:|"]
        out += [f"| {v} | {lang or '(none)'} | {n} | {s / 3600:.3f} |" for (v, lang), (n, s) in sorted(groups.items())]
    else:
        out = ["| voice | rows | hours |", "|---|---:|---:|"]
        out += [f"| {v} | {n} | {s / 3600:.3f} |" for (v, _), (n, s) in sorted(groups.items())]
        if languages:
            out += ["", f"Language: {', '.join(languages)} (as the engine declares its voice's; the rows have no "
                        "language column)."]
    return out


def _qc_sentence(qc: dict) -> str:
    flags = ", ".join(f"{f} {n}" for f, n in sorted((qc.get("flags") or {}).items())) or "none"
    text = (f"The quality gate ran in mode `{qc.get('mode')}`: {qc.get('measured', 0)} clips measured, "
            f"{qc.get('flagged', 0)} flagged on their first take (flags: {flags}), {qc.get('dead', 0)} with no speech.")
    if qc.get("failed"):
        text += f" {qc['failed']} rows were dropped by the gate."
    return text + " Each clip's signals are in its KEY.json `qc` and the manifest's `qc_*` columns."
