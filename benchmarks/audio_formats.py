"""What each audio format costs and keeps, side by side in one run: `cosybatch run` of the main job
(examples/corpus.parquet, the embedded voice) with --audio-format wav, flac and opus (32 kbit/s),
at the voice's own rate (22050 Hz; Opus at 24000, the nearest rate it holds) and at
--sample-rate 16000, each into a fresh --out, the variants taking turns within every round.

Per variant: the median wall time of the whole process, the audio members' bytes per hour of
audio and their share of WAV's at the voice's rate, and the clip's last stage (resampling and
encoding, stats.json stage_seconds.shape: the run's own account, steadier than whole-process times
on a shared machine) as a share of the wall time. Then the quality gate's Whisper (tiny.en through
CTranslate2, as `--qc asr` loads it) transcribes every clip of the last round's wav and opus jobs
at each rate, and the word error rate against the corpus text is compared: what Opus at 32 kbit/s
costs a model that hears it. Last, the clips' last stage alone (`shape`) on the wav job's clips, on
one thread and on --stage-threads, for each format: what it can keep up with.

    python benchmarks/audio_formats.py [--rounds 2] [--threads 1] [--no-wer] [--json PATH]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from common import ROOT, Report, alternate, cli, parse, table

sys.path.insert(0, str(ROOT))

VARIANTS = {
    "wav": [],
    "flac": ["--audio-format", "flac"],
    "opus32": ["--audio-format", "opus", "--bitrate", "32"],
    "wav-16k": ["--sample-rate", "16000"],
    "flac-16k": ["--audio-format", "flac", "--sample-rate", "16000"],
    "opus32-16k": ["--audio-format", "opus", "--bitrate", "32", "--sample-rate", "16000"],
}
GOALS = {"flac_bytes_vs_wav": 0.6, "shape_share": 0.05, "opus_wer_delta": 0.01}


def run_once(corpus: Path, out: Path, threads: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out), "--threads", str(threads),
           "--progress", "none", *extra]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t
    stats = json.loads((out / "stats.json").read_text())
    audio = sum(m.size for shard in out.glob("shard-*.tar") for m in tarfile.open(shard)
                if not m.name.endswith(".json"))
    return {"wall_s": wall, "audio_h": stats["audio_seconds"] / 3600, "member_bytes": audio,
            "mb_per_audio_h": audio / 1e6 / (stats["audio_seconds"] / 3600),
            "shape_share": stats["stage_seconds"]["shape"] / wall}


def corpus_wer(out: Path, transcriber) -> float:
    """Words wrong over words said, every clip of `out` against its text (Whisper's normaliser)."""
    from cosybatch.qc.asr import error_rates
    from cosybatch.store.audio import decode
    from cosybatch.store.exports import iter_shard

    errors = words = 0.0
    for shard in sorted(out.glob("shard-*.tar")):
        clips = [(meta["text"], *decode(data)) for _, meta, data in iter_shard(shard)]
        heard = transcriber.transcribe([(audio, rate) for _, audio, rate in clips], "en")
        for (text, _, _), hypothesis in zip(clips, heard, strict=True):
            n = len(text.split())
            errors += error_rates(text, hypothesis, "en")[1] * n
            words += n
    return errors / words


def stage_rates(out: Path, threads: int) -> dict:
    """The clips' last stage alone, as `run` does it (run/shaping.py `shape`), on every clip of the WAV
    job `out` taken as the engine's output: audio-seconds per second for each format on one thread
    and on `threads` threads (as RowLine's pool runs it)."""
    from concurrent.futures import ThreadPoolExecutor

    from cosybatch.config import OutputConfig
    from cosybatch.run.shaping import shape
    from cosybatch.store.audio import decode
    from cosybatch.store.exports import iter_shard

    clips = [decode(data) for shard in sorted(out.glob("shard-*.tar")) for _, _, data in iter_shard(shard)]
    audio_s = sum(len(a) / r for a, r in clips)
    rates: dict = {}
    for fmt in ("wav", "flac", "opus"):
        settings = OutputConfig(folder=out, audio_format=fmt)
        for n in sorted({1, threads}):
            t = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda c, s=settings: shape(c[0], c[1], s), clips))
            rates[f"{fmt}/{n}"] = round(audio_s / (time.perf_counter() - t), 1)
    return rates


def main() -> None:
    ap = cli(__doc__, rounds=2, threads=1, helps={"threads": "--threads of every `cosybatch run`"})
    ap.add_argument("--corpus", type=Path, default=ROOT / "examples" / "corpus.parquet", help="the corpus to run")
    ap.add_argument("--no-wer", action="store_true", help="skip the transcription of the wav and opus jobs")
    ap.add_argument("--stage-threads", type=int, default=2, help="threads of the last stage's own timing")
    args = parse(ap)

    with tempfile.TemporaryDirectory(prefix="audio-formats-") as tmp:
        def variant(name: str):
            def once(rnd: int) -> dict:
                out = Path(tmp) / f"{name}-{rnd}"
                shutil.rmtree(out, ignore_errors=True)
                return run_once(args.corpus, out, args.threads, VARIANTS[name])
            return once

        def say(rnd: int, name: str, figures: dict) -> None:
            print(f"round {rnd} {name}: {figures['wall_s']:.1f} s, {figures['mb_per_audio_h']:.1f} MB per audio hour",
                  file=sys.stderr)

        runs = alternate({name: variant(name) for name in VARIANTS}, args.rounds, baseline="wav", say=say)
        result = {"runs": runs.as_dict(), "goals": GOALS}
        result["stage_audio_s_per_s"] = stage_rates(Path(tmp) / f"wav-{args.rounds - 1}", args.stage_threads)
        wer: dict[str, float] = {}
        if not args.no_wer:
            from cosybatch.qc.asr import Transcriber, ready_model

            transcriber = Transcriber(ready_model(None), threads=args.threads)
            last = args.rounds - 1
            for name in ("wav", "opus32", "wav-16k", "opus32-16k"):
                wer[name] = corpus_wer(Path(tmp) / f"{name}-{last}", transcriber)
            result["wer"] = {k: round(v, 4) for k, v in wer.items()}
            result["opus_wer_delta"] = {"22050": round(wer["opus32"] - wer["wav"], 4),
                                        "16000": round(wer["opus32-16k"] - wer["wav-16k"], 4)}

    def show() -> None:
        rows = []
        for name in VARIANTS:
            rows.append([name, f"{runs.median(name, 'wall_s'):.1f}", f"{runs.median(name, 'mb_per_audio_h'):.1f}",
                         f"{runs.median(name, 'member_bytes') / runs.median('wav', 'member_bytes'):.3f}",
                         f"{100 * runs.median(name, 'shape_share'):.2f}%",
                         f"{wer[name]:.4f}" if name in wer else ""])
        table(["variant", "wall s", "MB per audio hour", "bytes vs wav", "last stage / wall", "WER (tiny.en)"], rows)
        print("the last stage alone, audio-s per s (format/threads):", result["stage_audio_s_per_s"])
        if wer:
            print(f"Opus 32 kbit/s WER - WAV WER: {wer['opus32'] - wer['wav']:+.4f} at 22050/24000 Hz, "
                  f"{wer['opus32-16k'] - wer['wav-16k']:+.4f} at 16000 Hz (goal: within {GOALS['opus_wer_delta']})")

    Report(args.json, "audio_formats").emit(result, show)


if __name__ == "__main__":
    main()
