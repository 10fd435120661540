"""How well the quality gate catches broken clips: recall per kind of injected failure and the
false-flag rate on clean rows, for the signals alone (``--qc gate``) and with every clip heard
(``--qc asr``), on a corpus whose clean clips are real default-voice output.

The corpus is synthesised once with ``cosybatch run --qc off`` and the clips are read back from its
shards. For each kind of failure, a run is played through the gate's own code
(`QualityGate.verdicts`: the clip floor aside, the very object a run judges with, its history and
calibration included): its rows in commit order, a seeded share of them (``--share``, 0.5; the
"broken batch" case 0.8) replaced by the failed version of their clip, the rest clean. A failed
row counts as caught when the gate fails it (or the clip floor rejects it); a clean row failed is a
false flag. Kinds:

  truncated      cut at a seeded 40-70% of its samples
  repeat         the clip said twice
  repeat_half    its first half said twice (first half, first half, second half)
  repeat_phrase  one inner phrase (speech between two pauses) said twice, seamlessly
  skip           one inner phrase left out
  run_on         1.5-2.5 s of another row's speech after the text
  silence        2 s of silence inserted in the middle 60%
  other_row      another (seeded) row's clip for this row's text
  noise          white noise at the clip's RMS
  zeros          digital silence (the clip floor rejects it before the gate)

Each row's expected length is its engine's own (`Engine.estimate_seconds`), as in a run.

    python benchmarks/qc_detection.py [--corpus examples/corpus.parquet] [--clips DIR] [--threads 2]
        [--modes gate,asr] [--kinds truncated,...] [--json PATH]

Prints, per kind, the recall and false-flag rate of each mode at share 0.5 and 0.8, and ends with
one JSON line.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import soundfile
from common import ROOT, Report, cli, parse

from cosybatch.config import RunConfig
from cosybatch.corpus import Row
from cosybatch.qc.asr import Transcriber, default_model_dir
from cosybatch.qc.gate import QCSettings
from cosybatch.qc.signals import FRAME_S, _runs, speech_frames
from cosybatch.qc.takes import Clip, QualityGate
from cosybatch.run.executor import ClipRejected, EngineSet, assemble_audio, expected_seconds
from cosybatch.run.shaping import shape

KINDS = ("truncated", "repeat", "repeat_half", "repeat_phrase", "skip", "run_on", "silence", "other_row", "noise",
         "zeros")
LENGTH_KINDS = ("truncated", "repeat", "repeat_half", "repeat_phrase", "skip", "run_on", "silence")
SHARES = (0.5, 0.8)  # failed share of a run's rows: half, and a broken batch
GOAL_HEARD, GOAL_SIGNALS, GOAL_FALSE = 0.95, 0.8, 0.02


def synthesise(corpus: Path, out: Path, threads: int) -> None:
    cmd = [sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out), "--qc", "off",
           "--threads", str(threads)]
    print("synthesising:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def read_clips(out: Path) -> list[dict]:
    """The clips of a finished run folder, in the order they were committed."""
    clips = []
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: m for m in tar.getmembers()}
            for name in members:
                if name.endswith(".wav"):
                    meta = json.loads(tar.extractfile(members[name[:-4] + ".json"]).read())
                    audio, rate = soundfile.read(io.BytesIO(tar.extractfile(members[name]).read()), dtype="float32")
                    clips.append({"id": meta["id"], "row": meta["row"], "text": meta["text"], "voice": meta["voice"],
                                  "audio": audio, "rate": rate})
    return clips


def phrases(audio: np.ndarray, rate: int) -> list[tuple[int, int]]:
    """(start, end) samples of each stretch of speech between pauses of 60 ms or more."""
    merged: list[list[int]] = []
    for a, b in _runs(speech_frames(audio, rate, bridge=False)):
        if merged and a - merged[-1][1] < 6:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    hop = round(FRAME_S * rate)
    return [(a * hop, b * hop) for a, b in merged]


def failed(clips: list[dict], i: int, kind: str, rng: np.random.Generator) -> np.ndarray | None:
    """Row i's clip with a `kind` failure; None when the clip has too few phrases for the kind."""
    a, rate, n = clips[i]["audio"], clips[i]["rate"], len(clips)
    other = clips[(i + int(rng.integers(1, n))) % n]["audio"]
    if kind == "truncated":
        return a[: int(len(a) * rng.uniform(0.4, 0.7))]
    if kind == "repeat":
        return np.concatenate([a, a])
    if kind == "repeat_half":
        h = len(a) // 2
        return np.concatenate([a[:h], a[:h], a[h:]])
    if kind == "silence":
        at = int(len(a) * rng.uniform(0.2, 0.8))
        return np.concatenate([a[:at], np.zeros(2 * rate, np.float32), a[at:]])
    if kind == "other_row":
        return other
    if kind == "zeros":
        return np.zeros_like(a)
    if kind == "noise":
        rms = float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))
        return (rng.standard_normal(len(a)) * rms).astype(np.float32)
    ph = phrases(a, rate)
    if kind == "run_on":
        length = int(rng.uniform(1.5, 2.5) * rate)
        start = max(0, len(other) // 2 - length // 2)
        end = ph[-1][1] if ph else len(a)
        return np.concatenate([a[:end], np.zeros(rate // 4, np.float32), other[start : start + length], a[end:]])
    if len(ph) < 3:
        return None
    k = int(rng.integers(1, len(ph) - 1))
    start, nxt = ph[k][0], ph[k + 1][0]
    if kind == "skip":
        return np.concatenate([a[:start], a[nxt:]])
    return np.concatenate([a[:nxt], a[start:]])  # repeat_phrase


def judge_run(clips: list[dict], expected: list, kind: str, share: float, settings: QCSettings, transcriber,
              seed: int, silence: float, cfg: RunConfig) -> dict:
    """One run with `share` of its rows failed by `kind`: the gate's verdict on every row."""
    rng = np.random.default_rng([seed, KINDS.index(kind), int(share * 100)])
    gate = QualityGate(settings, seed, silence, transcriber)
    bad, ok, caught, false = [], [], [], []
    batch: list[Clip] = []
    dead: list[bool] = []
    why_false: Counter = Counter()  # what failed the clean rows
    why_missed: Counter = Counter()  # the flags of failed rows that passed

    def flush() -> None:
        for clip, record in zip(batch, gate.verdicts(batch), strict=True):
            failing = record.get("pass") is False
            (caught if clip.ref else false).append(failing)
            if failing and not clip.ref:
                why_false[(record.get("reason") or "").split(" (")[0]] += 1
            elif clip.ref and not failing:
                why_missed[",".join(record["flags"]) or "-"] += 1
        batch.clear()

    for i, c in enumerate(clips):
        version = failed(clips, i, kind, rng) if rng.random() < share else None
        raw = c["audio"] if version is None else version
        (ok if version is None else bad).append(c["id"])
        try:
            audio = shape(assemble_audio([raw], c["rate"], cfg), c["rate"], cfg.output).audio
        except ClipRejected:
            dead.append(version is not None)
            (caught if version is not None else false).append(True)
            continue
        batch.append(Clip(version is not None, c["id"], c["row"], c["text"], c["voice"], c["rate"], audio=audio,
                          raw=[raw], expected_s=expected[i]))
        if len(batch) == 16:
            flush()
    flush()
    recall = round(float(np.mean(caught)), 4) if caught else None
    return {"failed_rows": len(bad), "clean_rows": len(ok), "recall": recall,
            "false_flags": round(float(np.mean(false)), 4) if false else 0.0,
            "calibration": gate.calibration.report(settings.limits), "false_flag_reasons": dict(why_false),
            "missed_with_flags": dict(why_missed)}


def main() -> None:
    ap = cli(__doc__, seed=0, threads=2, helps={"seed": "seed of the injected failures",
                                                 "threads": "synthesis and ASR threads"})
    ap.add_argument("--corpus", type=Path, default=ROOT / "examples" / "corpus.parquet", help="the corpus to run")
    ap.add_argument("--clips", type=Path, help="a finished `cosybatch run --qc off` folder of this corpus to reuse")
    ap.add_argument("--modes", default="gate,asr", help="comma-separated: gate (signals alone), asr (every clip heard)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds of failure")
    args = parse(ap)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qc-detection-") as tmp:
        folder = args.clips
        if folder is None:
            folder = Path(tmp) / "run"
            synthesise(args.corpus, folder, args.threads)
        clips = read_clips(folder)
    if not clips:
        raise SystemExit(f"no clips in {folder}")
    cfg = RunConfig.from_options(corpus=args.corpus, out=Path("unused"))
    engines = EngineSet(cfg)
    expected = []
    for c in clips:
        group, prepared, _ = engines.prepare(Row(index=c["row"], id=c["id"], text=c["text"]))
        expected.append(expected_seconds(engines.by_voice[group], prepared.pieces, cfg.output.sentence_silence_s))
    transcriber = Transcriber(default_model_dir(), "cpu", threads=args.threads)
    modes = args.modes.split(",")
    kinds = args.kinds.split(",")
    print(f"{len(clips)} clean clips of {args.corpus.name}, {sum(len(c['audio']) / c['rate'] for c in clips):.0f} "
          f"audio-s", flush=True)
    results: dict = {}
    for mode in modes:
        settings = QCSettings(mode=mode)
        for kind in kinds:
            for share in SHARES:
                t = time.perf_counter()
                r = judge_run(clips, expected, kind, share, settings, transcriber if mode == "asr" else None,
                              args.seed, cfg.output.sentence_silence_s, cfg)
                r["seconds"] = round(time.perf_counter() - t, 1)
                results.setdefault(mode, {}).setdefault(kind, {})[str(share)] = r
                print(f"{mode:5s} {kind:14s} share {share}: recall {r['recall']} false flags {r['false_flags']} "
                      f"({r['failed_rows']} failed, {r['clean_rows']} clean rows; {r['seconds']} s) "
                      f"false: {r['false_flag_reasons']}", flush=True)

    def worst(mode: str, pick) -> float:
        return min(results[mode][k][str(s)]["recall"] for k in kinds if pick(k) for s in SHARES
                   if results[mode][k][str(s)]["recall"] is not None)

    goals = {}
    if "asr" in results:
        goals["heard_recall"] = worst("asr", lambda k: True)
        goals["heard_false_flags"] = max(r["false_flags"] for k in kinds for r in results["asr"][k].values())
    if "gate" in results:
        goals["signals_length_recall"] = worst("gate", lambda k: k in LENGTH_KINDS)
        goals["signals_false_flags"] = max(r["false_flags"] for k in kinds for r in results["gate"][k].values())
    line = {"benchmark": "qc_detection", "corpus": args.corpus.name, "rows": len(clips), "seed": args.seed,
            "results": results, "goals": goals, "targets": {"heard_recall": GOAL_HEARD, "signals_length_recall":
                                                            GOAL_SIGNALS, "false_flags": GOAL_FALSE},
            "seconds": round(time.perf_counter() - t0, 1)}

    def show() -> None:
        print(f"\nrecall (false flags on the clean rows), {args.corpus.name}, share failed 0.5 | 0.8 (broken batch)")
        print(f"{'kind':14s} " + " ".join(f"{m:>30s}" for m in modes))
        for kind in kinds:
            cells = []
            for m in modes:
                r = results[m][kind]
                cells.append(" | ".join(f"{r[str(s)]['recall']:.2f} ({r[str(s)]['false_flags']:.3f})" for s in SHARES))
            print(f"{kind:14s} " + " ".join(f"{c:>30s}" for c in cells))
        print(f"\ngoals: {goals}")
        print(json.dumps(line))

    Report(args.json, "qc_detection").emit(line, show)


if __name__ == "__main__":
    main()
