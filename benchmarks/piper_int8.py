"""INT8 Piper voices (--precision int8) against fp32 and piper's own CLI.

Needs the measurement tools: pip install 'cosybatch[bench]' (pocketsphinx, jiwer, pesq,
mel-cepstral-distance).

1. Builds each int8 variant of the bundled voice (cosybatch/engines/piper/quant.py VARIANTS), calibrated on
   the first --calibration bundled calibration sentences (one calibration run serves them all).
2. In one process, 1 intra-op thread, batch 1 as the CPU default: synthesises the held-out
   sentences (cosybatch/data/piper_heldout_en.txt, never used to calibrate, not examples/) with fp32
   (2-D convolutions, the CPU default) and each variant, interleaved sentence by sentence, the same
   seeded noise for all. Reports the speed ratio vs fp32, how many clips have fp32's exact length,
   PESQ-WB and mel-cepstral distance against fp32 on those clips, waveform SNR, and WER of
   PocketSphinx's en-us model (a weaker recogniser than Whisper: compare int8 with fp32 under it,
   not with other WER figures) against the text, normalised by jiwer.
3. End to end as a user runs them, alternating: piper's CLI, `cosybatch run`, and `cosybatch run
   --precision int8` (its cache built beforehand), on the same sentences.

    python benchmarks/piper_int8.py [--variants decoder,flow-decoder,convs] [--rounds 3] [--e2e-rounds 3] \\
        [--json PATH]
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
from common import Report, Runs, alternate, cli, order, parse, sentences, turns, write_corpus
from scipy.signal import resample_poly

from cosybatch.engines import EngineOptions, open_engine
from cosybatch.engines.piper import PiperOptions
from cosybatch.engines.piper import quant as piper_quant
from cosybatch.engines.piper.voice import bundled_voice
from cosybatch.plan import Unit


def to_16k(audio: np.ndarray, rate: int) -> np.ndarray:
    return resample_poly(audio, 16000 // np.gcd(16000, rate), rate // np.gcd(16000, rate)).astype(np.float32)


class Recogniser:
    """PocketSphinx's bundled en-us acoustic model, dictionary and language model."""

    def __init__(self):
        from pocketsphinx import Decoder

        self.decoder = Decoder(samprate=16000, loglevel="FATAL")

    def __call__(self, audio_16k: np.ndarray) -> str:
        peak = float(np.abs(audio_16k).max()) or 1.0
        pcm = (audio_16k / peak * 0.9 * 32767).astype(np.int16).tobytes()
        self.decoder.start_utt()
        self.decoder.process_raw(pcm, full_utt=True)
        self.decoder.end_utt()
        hyp = self.decoder.hyp()
        return hyp.hypstr if hyp is not None else ""


def wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer

    norm = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(), jiwer.Strip(),
                          jiwer.ReduceToListOfListOfWords()])
    return jiwer.wer(refs, hyps, reference_transform=norm, hypothesis_transform=norm)


def pesq_wb(ref: np.ndarray, deg: np.ndarray, rate: int) -> float:
    from pesq import pesq

    return float(pesq(16000, to_16k(ref, rate), to_16k(deg, rate), "wb"))


def mcd(ref: np.ndarray, deg: np.ndarray, rate: int, tmp: Path) -> float:
    """Mel-cepstral distance (dB), frames paired one to one (the clips have equal lengths)."""
    from mel_cepstral_distance import compare_audio_files

    a, b = tmp / "mcd-a.wav", tmp / "mcd-b.wav"
    soundfile.write(a, ref, rate)
    soundfile.write(b, deg, rate)
    window_ms = 1024 / rate * 1000  # a power of two in samples
    return float(compare_audio_files(a, b, n_fft=window_ms, win_len=window_ms, hop_len=window_ms / 4,
                                     aligning="pad")[0])


def snr_db(ref: np.ndarray, deg: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - deg) ** 2), 1e-12)))


def units(engine, texts: list[str]) -> list[list[Unit]]:
    """Per sentence, its pieces (one batch each, as the CPU default batch of 1 runs them)."""
    out = []
    for row, text in enumerate(texts):
        p = engine.prepare(text, f"h{row:04d}")
        out.append([Unit(row, part, q.cost, "", q.payload) for part, q in enumerate(p.pieces)])
    return out


def in_process(models: dict[str, Path], config: Path, texts: list[str], rounds: int, tmp: Path, asr: bool) -> dict:
    engines = {}
    for name, model in models.items():
        folder = tmp / f"voice-{name}"
        folder.mkdir()
        os.symlink(model, folder / "v.onnx")
        shutil.copy(config, folder / "v.onnx.json")
        engines[name] = open_engine("piper", str(folder / "v.onnx"),
                                    EngineOptions(device="cpu", threads=1, engine=PiperOptions()))
    work = {name: units(eng, texts) for name, eng in engines.items()}
    names = list(engines)
    # Wall seconds and CPU seconds of this thread (onnxruntime runs a 1-thread session on the
    # caller's thread): on a shared machine CPU seconds vary less than wall seconds.
    runs = Runs(names, baseline="fp32")
    audio: dict[str, list[np.ndarray]] = {}
    for r, i, name in turns(names, rounds, len(texts)):  # interleaved: load on the machine hits all alike
        eng = engines[name]
        t, c = time.perf_counter(), time.thread_time()
        clips = [eng.synthesize([u]).audio[0] for u in work[name][i]]
        runs.add(name, r, wall_s=time.perf_counter() - t, cpu_s=time.thread_time() - c)
        if r == 0:
            audio.setdefault(name, [None] * len(texts))[i] = np.concatenate(clips)
        if i == len(texts) - 1 and name == order(names, r * len(texts) + i)[-1]:
            print(f"  round {r} (CPU s): " + ", ".join(f"{n} {runs.values(n, 'cpu_s')[r]:.1f}" for n in names),
                  flush=True)
    rate = engines["fp32"].sample_rate
    audio_s = sum(len(a) for a in audio["fp32"]) / rate
    recognise = Recogniser() if asr else None
    hyps = {name: [recognise(to_16k(a, rate)) for a in clips] for name, clips in audio.items()} if asr else {}
    results = {}
    for name in names:
        same = [i for i, a in enumerate(audio[name]) if len(a) == len(audio["fp32"][i])]
        row = {
            "speed_vs_fp32": 1 / runs.ratio(name, "cpu_s"),
            "speed_vs_fp32_wall": 1 / runs.ratio(name, "wall_s"),
            "audio_s_per_cpu_s": audio_s / runs.median(name, "cpu_s"),
            "cpu_s_per_round": runs.stats(name, "cpu_s"),
            "durations_equal": f"{len(same)}/{len(texts)}",
            "length_ratio": sum(len(a) for a in audio[name]) / sum(len(a) for a in audio["fp32"]),
        }
        if name != "fp32" and same:
            pairs = [(audio["fp32"][i], audio[name][i]) for i in same]
            row["pesq_wb"] = float(np.mean([pesq_wb(a, b, rate) for a, b in pairs]))
            row["mcd_db"] = float(np.mean([mcd(a, b, rate, tmp) for a, b in pairs]))
            row["snr_db"] = float(np.mean([snr_db(a, b) for a, b in pairs]))
        if asr:
            row["wer_pocketsphinx"] = wer(texts, hyps[name])
        results[name] = row
    return results


def end_to_end(texts: list[str], rounds: int, tmp: Path) -> dict:
    model, _ = bundled_voice()
    lines = tmp / "lines.txt"
    lines.write_text("\n".join(texts) + "\n", encoding="utf-8")
    corpus = write_corpus(texts, tmp / "corpus.parquet")
    runs = {
        "piper CLI": lambda out: [sys.executable, "-m", "piper", "-m", str(model), "-i", str(lines), "-d", str(out)],
        "cosybatch fp32": lambda out: [sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                                       "--progress", "none"],
        "cosybatch int8": lambda out: [sys.executable, "-m", "cosybatch", "run", str(corpus), "--out", str(out),
                                       "--progress", "none", "--precision", "int8"],
    }
    # The int8 model is built once per voice, before any timing (as `cosybatch quantize` does ahead).
    subprocess.run([sys.executable, "-m", "cosybatch", "quantize"], check=True, capture_output=True)
    # CPU seconds of each run too (user + system of the child): on a machine shared with other jobs
    # they vary far less than wall seconds. piper's CLI runs onnxruntime's default thread pool,
    # whose spinning threads count here; cosybatch's workers run 1-thread sessions.

    def tool(name: str):
        def once(r: int) -> dict:
            out = tmp / f"e2e-{name.replace(' ', '-')}-{r}"
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            proc = subprocess.run(runs[name](out), check=True, capture_output=True, text=True)
            wall = time.perf_counter() - t
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            if name == "piper CLI":
                audio = sum(soundfile.info(str(p)).duration for p in out.glob("*.wav"))
            else:
                audio = json.loads(proc.stdout.strip().splitlines()[-1])["audio_seconds"]
            print(f"  round {r}: {name:15s} {audio:7.1f} audio-s in {wall:6.1f} s ({cpu:6.1f} CPU s)", flush=True)
            return {"audio_s_per_s": audio / wall, "audio_s_per_cpu_s": audio / cpu}
        return once

    timed = alternate({name: tool(name) for name in runs}, rounds, baseline="piper CLI")
    return {name: {"audio_s_per_s": timed.median(name, "audio_s_per_s"),
                   "vs_piper_cli": timed.ratio(name, "audio_s_per_s"),
                   "audio_s_per_cpu_s": timed.median(name, "audio_s_per_cpu_s"),
                   "vs_piper_cli_cpu": timed.ratio(name, "audio_s_per_cpu_s"),
                   "range_audio_s_per_s": [min(timed.values(name, "audio_s_per_s")),
                                           max(timed.values(name, "audio_s_per_s"))],
                   "rounds_audio_s_per_s": timed.values(name, "audio_s_per_s")}
            for name in timed.names}


def main() -> None:
    ap = cli(__doc__, rounds=2, helps={"rounds": "timing rounds over the held-out sentences"})
    ap.add_argument("--variants", default=",".join(piper_quant.VARIANTS), help="comma-separated int8 variants")
    ap.add_argument("--calibration", type=int, default=piper_quant.CALIBRATION_SENTENCES,
                    help="bundled calibration sentences to calibrate on")
    ap.add_argument("--heldout", type=int, default=50, help="held-out sentences to synthesise and judge")
    ap.add_argument("--e2e-sentences", type=int, default=100, help="examples/sentences.txt lines for the CLI runs")
    ap.add_argument("--e2e-rounds", type=int, default=3, help="0 skips the end-to-end runs")
    ap.add_argument("--no-asr", action="store_true", help="skip the PocketSphinx WER")
    ap.add_argument("--no-in-process", action="store_true", help="only the end-to-end runs")
    args = parse(ap)
    model, config = bundled_voice()
    texts = piper_quant.read_sentences(piper_quant.HELDOUT_TEXT)[: args.heldout]
    calibration = piper_quant.read_sentences(piper_quant.CALIBRATION_TEXT)[: args.calibration]
    report: dict = {"heldout": len(texts), "calibration": len(calibration)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {"fp32": model}
        for name in [] if args.no_in_process else args.variants.split(","):
            t = time.perf_counter()
            models[name] = piper_quant.quantize_voice(model, config, tmp / f"{name}.onnx", name, calibration,
                                                      ranges_path=tmp / "ranges.json")
            print(f"built {name} in {time.perf_counter() - t:.0f} s", flush=True)
        if not args.no_in_process:
            print(f"in process, {len(texts)} held-out sentences, {args.rounds} rounds:", flush=True)
            report["in_process"] = in_process(models, config, texts, args.rounds, tmp, asr=not args.no_asr)
        if args.e2e_rounds:
            print(f"end to end, {args.e2e_sentences} sentences, {args.e2e_rounds} rounds:", flush=True)
            report["end_to_end"] = end_to_end(sentences(args.e2e_sentences), args.e2e_rounds, tmp)

    def show() -> None:
        print(json.dumps(report, indent=1))
        print("\n| variant | speed vs fp32 (CPU s) | durations equal fp32 | PocketSphinx WER | PESQ-WB vs fp32 "
              "| MCD dB | SNR dB |")
        print("|---|---|---|---|---|---|---|")
        for name, row in report.get("in_process", {}).items():
            print(f"| {name} | {row['speed_vs_fp32']:.2f}x | {row['durations_equal']} | "
                  f"{row.get('wer_pocketsphinx', float('nan')):.1%} | {row.get('pesq_wb', float('nan')):.2f} | "
                  f"{row.get('mcd_db', float('nan')):.2f} | {row.get('snr_db', float('nan')):.1f} |")
        for name, row in report.get("end_to_end", {}).items():
            print(f"end to end: {name:15s} {row['audio_s_per_s']:6.1f} audio-s/s, {row['vs_piper_cli']:.2f}x piper "
                  f"CLI; {row['audio_s_per_cpu_s']:6.1f} audio-s per CPU s, {row['vs_piper_cli_cpu']:.2f}x")

    Report(args.json, "piper_int8").emit(report, show)

if __name__ == "__main__":
    main()
