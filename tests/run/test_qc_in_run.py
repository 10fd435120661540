"""The quality gate inside a run, on real speech from the default voice and Whisper tiny.en: what
every clip records, the retakes and what a row with no passing take becomes, exactly once through
a kill during a retake, the fingerprint, and the usage errors. The faults are made by the test
plugin's `faulty-piper` engine (tests/plugin/cosybatch_tone/faulty.py): the default voice, with
rows named ``twice-*`` said twice in their first take and ``always-twice-*`` in every take."""

from __future__ import annotations

import json
import signal

import pyarrow.parquet as pq
import pytest
from helpers import assert_complete, cli, last_json, read_output, start_run, write_jsonl

from cosybatch.config import RunConfig
from cosybatch.errors import ResumeMismatchError
from cosybatch.run.local import run

ROWS = [
    {"id": "good-1", "text": "Please call me back when you get this message."},
    {"id": "gibberish", "text": "Zxqv plomb krnthu vexilu grob tazzik."},  # no real words, but said as written
    {"id": "good-2", "text": "The weather tomorrow will be sunny with a light breeze."},
    {"id": "good-3", "text": "We will meet again in the spring of next year."},
]
FAULTY = [
    {"id": "good-1", "text": ROWS[0]["text"]},
    {"id": "always-twice-1", "text": "The museum opens at nine and closes early on Sundays."},  # never passes
    {"id": "twice-1", "text": ROWS[2]["text"]},  # its first take is said twice; its second is right
    {"id": "gibberish", "text": ROWS[1]["text"]},
]


def config(corpus, out, **settings) -> RunConfig:
    return RunConfig.from_options(corpus=corpus, out=out, progress="none", **settings)


def failures(out) -> dict:
    return {f["id"]: f for f in map(json.loads, (out / "failures.jsonl").read_text().splitlines())}


def test_signals_are_recorded_by_default_everywhere(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", ROWS)
    out = tmp_path / "out"
    result = run(config(corpus, out))
    assert result.status == "complete" and result.stats["items_done"] == 4  # measured, nothing dropped
    items = assert_complete(out, ROWS)
    for item in items.values():
        qc = item["meta"]["qc"]
        assert qc["attempt"] == 0 and "pass" not in qc and "asr" not in qc
        assert qc["signals"]["duration_s"] == pytest.approx(len(item["audio"]) / item["sample_rate"], abs=1e-3)
        assert 0.8 < qc["signals"]["speech_share"] <= 1 and qc["signals"]["tail_s"] < 0.5
    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    assert {r["id"]: r["qc_speech_share"] for r in manifest} == \
        {i: it["meta"]["qc"]["signals"]["speech_share"] for i, it in items.items()}
    stats = json.loads((out / "stats.json").read_text())
    assert stats["qc"]["mode"] == "signals" and stats["qc"]["measured"] == 4
    assert "qc" not in json.loads((out / ".cosybatch" / "job.json").read_text())["fingerprint"]


def test_the_gate_hears_every_row_retakes_a_doubled_one_and_drops_one_never_right(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", FAULTY)
    out = tmp_path / "out"
    result = run(config(corpus, out, engine="faulty-piper", qc="asr"))  # --qc-asr-rows all is the default
    assert result.status == "complete"
    assert (result.stats["items_done"], result.stats["items_failed"]) == (3, 1)
    items = read_output(out)
    assert sorted(items) == ["gibberish", "good-1", "twice-1"]
    for item in items.values():
        qc = item["meta"]["qc"]
        assert qc["pass"] is True and qc["asr"]["support"] >= 3.0 and qc["asr"]["beyond_s"] < 0.5
        spoken = [w[0].strip(".,").lower() for w in qc["asr"]["words"] if w[0].strip(".,")]
        assert spoken == [w.strip(".,").lower() for w in item["meta"]["text"].split()]  # every word placed
    retaken = items["twice-1"]["meta"]["qc"]
    assert retaken["attempt"] == 1 and "speech past the text" in retaken["attempts"][0]["reason"]
    assert items["twice-1"]["meta"]["duration"] < retaken["attempts"][0]["signals"]["duration_s"] / 1.8
    failed = failures(out)["always-twice-1"]
    assert failed["reason"].startswith("qc: ") and failed["reason"].endswith("after 3 attempts")
    assert "speech past the text" in failed["reason"] or "too_long" in failed["reason"]
    takes = failed["qc"]["attempts"]
    assert [t["attempt"] for t in takes] == [0, 1, 2] and all(t["pass"] is False for t in takes)
    # Each take is new audio: the attempt is in the seeds.
    assert len({t["signals"]["duration_s"] for t in takes}) == 3
    qc = result.stats["qc"]
    assert (qc["retries"], qc["failed"], qc["passed"], qc["passed_after_retry"]) == (3, 1, 3, 1)
    assert qc["transcribed"] == 4 + 3 and qc["asr_rows"] == "all"  # four first takes, three retakes, all heard


def test_the_gate_judges_the_samples_as_written(tmp_path, monkeypatch):
    """The run and `cosybatch qc` hear the same audio: the gate gets the 16-bit samples each WAV
    member holds, as any reader decodes them, not the float clip before it was written."""
    import numpy as np

    from cosybatch.qc.signals import measure
    from cosybatch.qc.takes import QualityGate

    judged = {}
    settle = QualityGate.settle

    def spy(self, clips, remake):
        judged.update({c.row_id: c.audio.copy() for c in clips})
        return settle(self, clips, remake)

    monkeypatch.setattr(QualityGate, "settle", spy)
    corpus = write_jsonl(tmp_path / "c.jsonl", ROWS[:2])
    run(config(corpus, tmp_path / "out"))
    items = read_output(tmp_path / "out")
    assert sorted(judged) == sorted(items)
    for item_id, item in items.items():
        assert np.array_equal(judged[item_id], item["audio"])
        signals = measure(item["audio"], item["sample_rate"], item["meta"]["text"]).as_dict()
        recorded = item["meta"]["qc"]["signals"]
        assert {k: signals[k] for k in signals if k != "clipped"} == {k: recorded[k] for k in signals if k != "clipped"}


def test_keep_commits_the_best_take_marked_failing(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", FAULTY[:2])
    out = tmp_path / "out"
    result = run(config(corpus, out, engine="faulty-piper", qc="asr", qc_on_fail="keep", qc_retries=1))
    assert (result.stats["items_done"], result.stats["items_failed"]) == (2, 0)
    qc = read_output(out)["always-twice-1"]["meta"]["qc"]
    assert qc["pass"] is False and len(qc["attempts"]) == 2
    best = min(qc["attempts"], key=lambda t: t["score"])
    assert qc["attempt"] == best["attempt"] and qc["asr"] == best["asr"]
    row = {r["id"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}["always-twice-1"]
    assert row["qc_pass"] is False and row["qc_attempts"] == 2 and row["qc_support"] == qc["asr"]["support"]


def test_a_threshold_from_the_job_spec_fails_rows_without_asr(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", ROWS[:2])
    spec = tmp_path / "job.toml"
    spec.write_text(f'corpus = "{corpus}"\nout = "{tmp_path / "out"}"\nprogress = "none"\n'
                    '[qc]\nmode = "gate"\nretries = 1\nmin_speech_share = 0.999\n')
    proc = cli("run", "--job", spec)
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc)["items_failed"] == 2
    for failed in failures(tmp_path / "out").values():
        assert failed["reason"] == "qc: low_speech after 2 attempts"
    fingerprint = json.loads((tmp_path / "out" / ".cosybatch" / "job.json").read_text())["fingerprint"]
    assert fingerprint["qc"]["min_speech_share"] == 0.999 and fingerprint["qc"]["mode"] == "gate"


def test_a_gate_is_part_of_the_job_and_measuring_is_not(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", ROWS[:1])
    out = tmp_path / "out"
    run(config(corpus, out))
    assert run(config(corpus, out, qc="off")).status == "complete"  # signals on or off: the same audio
    with pytest.raises(ResumeMismatchError, match="qc"):
        run(config(corpus, out, qc="gate"))


def test_a_missing_asr_model_is_a_usage_error_before_anything_is_written(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", ROWS[:1])
    (tmp_path / "nomodel").mkdir()
    proc = cli("run", corpus, "--out", tmp_path / "out", "--qc", "asr", "--qc-asr-model", tmp_path / "nomodel")
    assert proc.returncode == 2
    assert "not a CTranslate2 Whisper folder (missing model.bin, config.json, tokenizer.json)" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_kill_during_a_retake_then_resume_exactly_once(tmp_path):
    rows = [{"id": f"ok-{i}", "text": r["text"]} for i, r in enumerate(ROWS * 3) if r["id"] != "gibberish"]
    rows.insert(4, {"id": "always-twice-1", "text": ROWS[1]["text"]})
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    proc = start_run(corpus, out, "--engine", "faulty-piper", "--qc", "asr", shard_max_items=2)
    for line in proc.stderr:  # the gate says when it makes a row again; kill it in that take
        if "made again (take 2 of 3)" in line:
            proc.send_signal(signal.SIGKILL)
            break
    else:
        raise AssertionError(f"the run ended before any retake: {proc.communicate()}")
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    result = run(config(corpus, out, engine="faulty-piper", qc="asr", shard_max_items=2))
    assert result.status == "complete"
    good = [r for r in rows if r["id"] != "always-twice-1"]
    assert_complete(out, good)
    assert list(failures(out)) == ["always-twice-1"]
    assert failures(out)["always-twice-1"]["reason"].endswith("after 3 attempts")
    assert cli("verify", out).returncode == 0


def test_a_voice_the_asr_cannot_hear_gets_the_signals_only_said_at_start(tmp_path, caplog):
    from cosybatch.engines.piper.voice import bundled_voice

    model, voice_config = bundled_voice()
    raw = json.loads(voice_config.read_text())
    raw["language"] = {"code": "de_DE", "family": "de"}  # tiny.en hears English only
    (tmp_path / "de_DE-test.onnx").symlink_to(model)
    (tmp_path / "de_DE-test.onnx.json").write_text(json.dumps(raw))
    corpus = write_jsonl(tmp_path / "c.jsonl", ROWS[:2])
    with caplog.at_level("WARNING", logger="cosybatch"):
        result = run(config(corpus, tmp_path / "out", voice=str(tmp_path / "de_DE-test.onnx"), qc="asr",
                            qc_asr_rows="all"))
    said = [r.getMessage() for r in caplog.records if "cannot hear 'de'" in r.getMessage()]
    assert len(said) == 1 and "--qc-asr-model" in said[0]
    assert result.stats["qc"]["transcribed"] == 0 and result.stats["items_done"] == 2  # judged on signals
    assert all("asr" not in item["meta"]["qc"] for item in read_output(tmp_path / "out").values())
