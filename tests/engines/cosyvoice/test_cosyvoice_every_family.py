"""What every CosyVoice family does the same, once per family (v1, v2, v3) on its tiny folder.

Family-specific checks (parity against upstream, golden fixtures, v1's relative-position LM, v3's
DiT and system prompt) live in the per-family files beside this one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from helpers import ROOT, read_output, write_parquet

from cosybatch.config import RunConfig
from cosybatch.cosyvoice.flow.v1 import mel_frames
from cosybatch.engines import EngineOptions, VoiceRequest, open_engine
from cosybatch.engines.cosyvoice import CosyVoiceOptions, check_setup
from cosybatch.plan import Unit
from cosybatch.run.local import run

JOE = ROOT / "examples" / "prompt-joe.wav"
JOE_TEXT = "The quick brown fox jumps over the lazy dog, then rests by the river."


@dataclass(frozen=True)
class Family:
    name: str  # v1, v2, v3
    model: Path
    kind: str  # what `check` reports as the family
    version: int
    sample_rate: int
    samples_per_frame: int  # vocoder samples per mel frame
    speakers: tuple[str, ...]  # built-in (spk2info.pt) speakers of the tiny folder
    follows_instructions: bool

    @property
    def whole(self) -> int:
        """A one-segment row's audio is a whole number of these samples: mel frames for v1, speech
        tokens (2 mel frames each) for v2 and v3."""
        return self.samples_per_frame if self.version == 1 else 2 * self.samples_per_frame

    def samples(self, tokens: int) -> int:
        """Samples of a prompt-free one-segment row that decoded ``tokens`` speech tokens."""
        if self.version == 1:  # the v1 flow interpolates 50 Hz tokens to 22050/256 Hz mel frames
            return mel_frames(tokens) * self.samples_per_frame
        return tokens * self.whole

    def voice(self, speaker: str) -> dict:
        """Row columns for a fixed voice: the built-in ``speaker``, or (v3 folders ship no
        spk2info.pt) a zero-shot prompt."""
        if self.speakers:
            return {"speaker": speaker}
        return {"prompt_wav": "joe.wav", "prompt_text": JOE_TEXT}

    def request(self, speaker: str) -> VoiceRequest:
        v = self.voice(speaker)
        return VoiceRequest(v.get("speaker"), v.get("prompt_wav"), v.get("prompt_text"), True)


@pytest.fixture(scope="module", params=["v1", "v2", "v3"])
def family(request) -> Family:
    if request.param == "v1":
        return Family("v1", request.getfixturevalue("cosyvoice_v1_dir"), "CosyVoice-300M-SFT", 1, 22050, 256,
                      ("alice", "bob", "carol"), False)
    if request.param == "v2":
        return Family("v2", request.getfixturevalue("cosyvoice_dir"), "CosyVoice2-0.5B", 2, 24000, 480,
                      ("alice", "bob"), True)
    return Family("v3", request.getfixturevalue("cosyvoice_v3_dir"), "Fun-CosyVoice3-0.5B", 3, 24000, 480, (), True)


@pytest.fixture(scope="module")
def corpus(family, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(f"cv-{family.name}-corpus")
    t = np.linspace(0, 1.5, 24000, endpoint=False)
    sf.write(folder / "prompt.wav", (0.3 * np.sin(2 * np.pi * (180 + 60 * t) * t)).astype("float32"), 16000)
    shutil.copy(JOE, folder / "joe.wav")
    sf.write(folder / "long.wav", np.zeros(31 * 16000, dtype="float32"), 16000)
    (folder / "notaudio.wav").write_text("not a wav file")
    rows = [
        {"id": "sft-a", "text": "Hello there.", **family.voice("alice")},
        {"id": "sft-b", "text": "The kettle is boiling, so please bring two cups.", **family.voice("bob")},
        {"id": "zero-shot", "text": "Zero-shot cloning works too.", "prompt_wav": "prompt.wav",
         "prompt_text": "A short prompt."},
        {"id": "cross", "text": "A prompt without its text sets only the voice.", "prompt_wav": "prompt.wav"},
        {"id": "told", "text": "With a style.", **family.voice("alice"), "instruct": "Whisper it."},
        {"id": "bad-speaker", "text": "Unknown speaker.", "speaker": "zed"},
        {"id": "bad-missing", "text": "Missing prompt file.", "prompt_wav": "nope.wav", "prompt_text": "x"},
        {"id": "bad-long", "text": "Prompt over thirty seconds.", "prompt_wav": "long.wav", "prompt_text": "x"},
        {"id": "bad-format", "text": "Prompt that is not audio.", "prompt_wav": "notaudio.wav", "prompt_text": "x"},
        {"id": "reuse", "text": "The same prompt again, computed once.", "prompt_wav": "prompt.wav",
         "prompt_text": "A short prompt."},
        {"id": "bad-outside", "text": "A prompt outside the corpus folder.", "prompt_wav": "../prompt.wav",
         "prompt_text": "x"},
        {"id": "no-voice", "text": "Neither a speaker nor a prompt."},
    ]
    for row in rows:
        for column in ("speaker", "prompt_wav", "prompt_text", "instruct"):
            row.setdefault(column, None)
    return write_parquet(folder / "corpus.parquet", rows)


@pytest.fixture(scope="module")
def engine(family, corpus):
    return open_engine("cosyvoice", None, EngineOptions(device="cpu", corpus_dir=corpus.parent,
                                                        engine=CosyVoiceOptions(model=family.model)))


def job(family: Family, corpus: Path, out: Path, **settings) -> RunConfig:
    return RunConfig.from_options(corpus=corpus, out=out, engine="cosyvoice", device="cpu", progress="none",
                     engine_options={"model": family.model}, **settings)


def run_row(engine, text: str, item_id: str, voice: VoiceRequest) -> tuple[np.ndarray, int]:
    prepared = engine.prepare(text, item_id, voice)
    units = [Unit(0, part, piece.cost, "", piece.payload)
             for part, piece in enumerate(prepared.pieces)]
    syn = engine.synthesize(units)
    # The speech tokens the flow got (real_frames also counts each piece's stop step).
    return np.concatenate(syn.audio), sum(info["tokens"] for info in syn.lm)


def test_check_reports_the_family(family):
    report = check_setup(family.model, None, None, None)
    assert (report["family"], report["version"], report["sample_rate"]) == \
        (family.kind, family.version, family.sample_rate)
    assert report["speakers"] == list(family.speakers)


@pytest.fixture(scope="module")
def resumed(family, corpus, tmp_path_factory):
    """The family's job run twice, as the two tests below read it: its first 3 rows, then resumed
    to the end. (first result, second result, the items after the first run, the folder)"""
    out = tmp_path_factory.mktemp(f"cv-{family.name}-job") / "out"
    first = run(job(family, corpus, out, limit=3, normalize=False))
    before = read_output(out)
    second = run(job(family, corpus, out, normalize=False))
    return first, second, before, out


def test_run_writes_every_row_once_with_exact_lengths_and_bad_rows_fail_alone(family, engine, resumed):
    first, result, _, out = resumed
    assert first.status == result.status == "complete"
    good = ["cross", "reuse", "sft-a", "sft-b", "zero-shot"] + (["told"] if family.follows_instructions else [])
    bad = ["bad-format", "bad-long", "bad-missing", "bad-outside", "bad-speaker", "no-voice"]
    bad += [] if family.follows_instructions else ["told"]
    totals = result.stats["job_totals"]
    assert (totals["items_done"], totals["items_failed"]) == (len(good), len(bad))

    items = read_output(out)
    assert sorted(items) == sorted(good)
    failures = {f["id"]: f["reason"] for f in map(json.loads, (out / "failures.jsonl").read_text().splitlines())}
    assert sorted(failures) == sorted(bad)
    assert "outside" in failures["bad-outside"] and "--prompt-dir" in failures["bad-outside"]
    if family.speakers:
        assert "unknown speaker 'zed'" in failures["bad-speaker"] and "alice" in failures["bad-speaker"]
    else:
        assert "'zed'" in failures["bad-speaker"] and "no built-in speakers" in failures["bad-speaker"]
    assert "30" in failures["bad-long"]
    assert "nope.wav" in failures["bad-missing"]
    assert "notaudio.wav" in failures["bad-format"]
    assert "no voice" in failures["no-voice"]
    if not family.follows_instructions:
        assert "cannot follow instructions" in failures["told"]

    voices = {
        "sft-a": family.request("alice"),
        "sft-b": family.request("bob"),
        "zero-shot": VoiceRequest(None, "prompt.wav", "A short prompt.", True),
        "cross": VoiceRequest(None, "prompt.wav", None, True),
    }
    for item_id, voice in voices.items():
        item = items[item_id]
        assert item["sample_rate"] == family.sample_rate
        assert len(item["audio"]) % family.whole == 0
        assert np.abs(item["audio"]).max() > 0.01
        # The same row through the engine directly: same tokens (same seed and id), so same length.
        meta = item["meta"]
        audio, tokens = run_row(engine, meta.get("source_text", meta["text"]), item_id, voice)
        assert len(item["audio"]) == len(audio)
        if family.speakers:  # no prompt: the length follows from the tokens alone
            assert len(audio) == family.samples(tokens)
    assert items["zero-shot"]["meta"]["voice"].startswith("prompt:")
    assert items["zero-shot"]["meta"]["voice"] == items["reuse"]["meta"]["voice"]
    if family.speakers:
        assert items["sft-a"]["meta"]["voice"] == "spk:alice"
    if family.follows_instructions:
        assert items["told"]["meta"]["instruct"] == "Whisper it." and "instruct" not in items["sft-a"]["meta"]
    # CosyVoice2's settings name no family, so fingerprints of its earlier runs stay valid.
    assert items["cross"]["meta"]["settings"].get("family", "CosyVoice2-0.5B") == family.kind


def test_resume_completes_without_duplicates(family, resumed):
    first, second, before, out = resumed
    assert first.status == "complete" and first.stats["items_done"] == 3
    assert sorted(before) == ["sft-a", "sft-b", "zero-shot"]
    assert second.status == "complete" and second.stats["items_done"] == len(read_output(out)) - 3  # none redone
    after = read_output(out)  # fails on any id written twice
    assert sorted(after) == sorted(["cross", "reuse", "sft-a", "sft-b", "zero-shot"]
                                   + (["told"] if family.follows_instructions else []))
    for item_id, item in before.items():
        assert np.array_equal(item["audio"], after[item_id]["audio"])


def test_item_audio_does_not_depend_on_its_batch(family, engine):
    voice = family.request("alice")
    text = "One sentence to compare. And a second one, a little longer than the first."
    alone, tokens = run_row(engine, text, "row-7", voice)
    # The same row planned into one batch with other rows and voices.
    others = [("x", "Something else entirely.", family.request("bob")),
              ("y", "Another row with a prompt voice.", VoiceRequest(None, "prompt.wav", "A short prompt.", True))]
    units = []
    for key, (item_id, t, v) in enumerate([("row-7", text, voice), *others]):
        prepared = engine.prepare(t, item_id, v)
        units += [Unit(key, part, piece.cost, "", piece.payload)
                  for part, piece in enumerate(prepared.pieces)]
    syn = engine.synthesize(units)
    mine = np.concatenate([a for u, a in zip(units, syn.audio, strict=True) if u.row_key == 0])
    assert len(mine) == len(alone)
    if family.speakers:
        assert len(alone) == family.samples(tokens)
    snr = 10 * np.log10((alone**2).sum() / max(((alone - mine) ** 2).sum(), 1e-30))
    assert snr > 60, "batched audio must equal the item's own (up to float rounding)"
