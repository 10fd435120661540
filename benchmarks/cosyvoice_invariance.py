"""Does a row's audio depend on how it was batched? The same rows through the CosyVoice engine
one at a time (1 slot, flow and vocoder batch 1) and all together (more slots, larger flow and
vocoder batches): are the speech tokens identical, and how close is each row's waveform (SNR)?

Sampling stays on (seeded per row), so identical tokens show that a row's randomness and logits
do not depend on its neighbours; waveform differences come from batched matmuls rounding
differently, amplified by the vocoder's phase integration (see the README).

    python benchmarks/cosyvoice_invariance.py                 # tiny weights, CPU
    python benchmarks/cosyvoice_invariance.py --size real     # real sizes (slow on CPU)
    python benchmarks/cosyvoice_invariance.py --family v1     # CosyVoice-300M (v3: Fun-CosyVoice3)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from common import Report, cli, parse

from cosybatch.engines import EngineOptions, VoiceRequest, open_engine
from cosybatch.engines.cosyvoice import CosyVoiceOptions
from cosybatch.plan import Unit

TEXTS = [
    "Hello there.",
    "The kettle is boiling, so please bring two cups and the biscuits from the shelf.",
    "A short one.",
    "Every morning the ferry leaves at seven, crosses the bay, and returns before noon.",
    "Numbers like 42 and 1,000 are read out in words.",
    "She said nothing, smiled, and walked on.",
    "This sentence is a little longer than most of the others in the list, on purpose.",
    "Goodbye.",
]


def write_model(folder: Path, family: str, size: str) -> Path:
    """A tiny (or real-size) random-weight folder of the family, with built-in speakers."""
    if family == "v1":
        from cosybatch.cosyvoice.tiny.v1 import write_model_dir

        return write_model_dir(folder / "CosyVoice-300M-SFT", variant="sft", size=size)
    if family == "v3":
        from cosybatch.cosyvoice.tiny.v3 import write_model_dir

        if size != "tiny":
            raise SystemExit("--family v3: only tiny folders are written (its writer has no real sizes yet)")
        return write_model_dir(folder / "Fun-CosyVoice3-0.5B")
    from cosybatch.cosyvoice.tiny import write_model_dir

    return write_model_dir(folder / "model", size=size)


def voice_for(engine, folder: Path) -> VoiceRequest:
    """The built-in speaker alice, or (a folder without speakers) a zero-shot prompt."""
    if "alice" in engine.voices.speakers:
        return VoiceRequest("alice", None, None, True)
    import soundfile as sf

    path = folder / "prompt.wav"
    if not path.exists():
        t = np.linspace(0, 1.5, 24000, endpoint=False)
        sf.write(path, (0.3 * np.sin(2 * np.pi * (180 + 60 * t) * t)).astype("float32"), 16000)
    return VoiceRequest(None, str(path), "A short prompt.", False)


def run(engine, rows, together: bool, voice: VoiceRequest) -> tuple[dict, dict, dict]:
    """(audio per row id, tokens per segment seed, row id per segment seed)."""
    tokens: dict[int, list[int]] = {}
    decode = engine.lm.decode

    def recording(requests, *a, **k):
        out = decode(requests, *a, **k)
        for r, t in zip(requests, out[0], strict=True):
            tokens[r.seed] = list(t)
        return out

    engine.lm.decode = recording
    units, owners, seeds = [], [], {}
    for key, (item_id, text) in enumerate(rows):
        prepared = engine.prepare(text, item_id, voice)
        for part, piece in enumerate(prepared.pieces):
            cost, payload = piece.cost, piece.payload
            units.append(Unit(key, part, cost, "", payload))
            owners.append(item_id)
            seeds[payload.seed] = item_id
    audio: dict[str, list[np.ndarray]] = {item_id: [] for item_id, _ in rows}
    batches = [units] if together else [[u] for u in units]
    for batch in batches:
        syn = engine.synthesize(batch)
        for unit, wav in zip(batch, syn.audio, strict=True):
            audio[owners[units.index(unit)]].append(wav)
    engine.lm.decode = decode
    return {k: np.concatenate(v) for k, v in audio.items()}, tokens, seeds


def main() -> None:
    ap = cli(__doc__)
    ap.add_argument("--size", choices=("tiny", "real"), default="tiny", help="random weights of this size")
    ap.add_argument("--family", choices=("v1", "v2", "v3"), default="v2",
                    help="v1: CosyVoice-300M-SFT, v2: CosyVoice2, v3: Fun-CosyVoice3")
    args = parse(ap)
    torch.set_num_threads(1)
    rows = [(f"row-{i}", t) for i, t in enumerate(TEXTS)]
    result = {"family": args.family, "size": args.size, "rows": len(rows), "configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp), args.family, args.size)

        def engine(**opts):
            return open_engine("cosyvoice", None, EngineOptions(device="cpu", threads=1, engine=CosyVoiceOptions(
                model=model, **opts)))

        first = engine(lm_slots=1, flow_batch=1, hift_batch=1)
        voice = voice_for(first, Path(tmp))
        reference, ref_tokens, seeds = run(first, rows, together=False, voice=voice)
        for name, opts in {"defaults, one batch": {}, "8 slots, flow and vocoder batch 8":
                           {"lm_slots": 8, "flow_batch": 8, "hift_batch": 8}}.items():
            audio, tokens, _ = run(engine(**opts), rows, together=True, voice=voice)
            assert sorted(tokens) == sorted(ref_tokens) and ref_tokens, "every segment's tokens were recorded"
            diverged = {seeds[k] for k in ref_tokens if tokens[k] != ref_tokens[k]}
            first = [next((i for i, (a, b) in enumerate(zip(ref_tokens[k], tokens[k], strict=False)) if a != b), None)
                     for k in ref_tokens if tokens[k] != ref_tokens[k]]
            snr, diff = [], 0.0
            for item_id, want in reference.items():
                if item_id in diverged:
                    continue  # other tokens, other audio: not a rounding difference
                got = audio[item_id]
                assert len(got) == len(want), f"{item_id}: {len(got)} vs {len(want)} samples"
                noise = float(((got - want) ** 2).sum())
                snr.append(float("inf") if noise == 0 else 10 * np.log10(float((want**2).sum()) / noise))
                diff = max(diff, float(np.abs(got - want).max()) * 32768)
            result["configs"][name] = {
                "segments": len(tokens), "segments_identical": len(tokens) - len(first),
                "diverged_at_token": first, "rows_compared": len(snr),
                "snr_db_min": round(min(snr), 1), "snr_db_median": round(float(np.median(snr)), 1),
                "bit_identical_rows": sum(x == float("inf") for x in snr), "max_diff_16bit_lsb": round(diff, 1),
            }

    def show() -> None:
        print(f"{args.family}: {len(rows)} rows, {args.size} weights, CPU; reference: one segment at a time, 1 slot")
        for name, r in result["configs"].items():
            print(f"{name}: tokens identical in {r['segments_identical']} of {r['segments']} segments "
                  f"(others diverge at token {r['diverged_at_token']}); on the {r['rows_compared']} rows with "
                  f"identical tokens: {r['bit_identical_rows']} bit-identical, SNR min {r['snr_db_min']} dB, median "
                  f"{r['snr_db_median']} dB, max diff {r['max_diff_16bit_lsb']} LSB")

    Report(args.json, "cosyvoice_invariance").emit(result, show)


if __name__ == "__main__":
    main()
