"""Issue 31, first note: a `Prepared` or `Synthesised` of the wrong shape (a plugin built on an
older contract) is an EngineError naming the engine and the field, never "internal error:
AttributeError": a bad Prepared ends the job at its first row (every row would break the same
way); a bad Synthesised fails that batch's rows with the message and the job ends normally."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
from helpers import write_jsonl

from cosybatch.config import RunConfig
from cosybatch.engines import Engine, Piece, Prepared, Synthesised, register_engine
from cosybatch.engines import registry as registry_module
from cosybatch.errors import EngineError
from cosybatch.run.local import run


@pytest.fixture(autouse=True)
def only_this_tests_engines(monkeypatch):
    monkeypatch.setattr(registry_module, "_IN_PROCESS", {})


class Base(Engine):
    def __init__(self, voice, options):
        self.sample_rate, self.device, self.voice_name = 8000, "cpu", "v"

    def describe(self):
        return {}

    def prepare(self, text, item_id, voice):
        return Prepared((Piece(cost=len(text), payload=len(text)),), text)

    def synthesize(self, units):
        clips = [np.sin(np.arange(10 * u.payload, dtype=np.float32)) for u in units]
        return Synthesised(clips, real_frames=1, padded_frames=1)


@dataclass(frozen=True)
class OldPrepared:  # what the old contract's Prepared(costs, payloads, text) held
    pieces: tuple
    text: object


def job(tmp_path, engine: str):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "text": "One."}, {"id": "b", "text": "Two two."}])
    return RunConfig.from_options(corpus=corpus, out=tmp_path / "out", engine=engine, progress="none",
                                  max_failures="100%")


@pytest.mark.parametrize(("returned", "field"), [
    (lambda t: Prepared([4, 5], ("p", "q"), t), "Prepared.pieces[0] 4 (a int), not a Piece"),  # old positional
    (lambda t: Prepared((Piece(cost="4", payload=1),), t), "Prepared.pieces[0].cost '4' (a str), not an int"),
    (lambda t: Prepared((Piece(cost=4, payload=1),), 7), "Prepared.text 7 (a int), not a str"),
    (lambda t: Prepared(5, t), "Prepared.pieces 5 (a int), not a tuple of Piece"),
    (lambda t: {"pieces": []}, "not a Prepared"),
])
def test_a_prepared_of_the_wrong_shape_ends_the_job_naming_engine_and_field(tmp_path, returned, field):
    @register_engine
    class Old(Base):
        name = "old"

        def prepare(self, text, item_id, voice):
            return returned(text)

    with pytest.raises(EngineError) as info:
        run(job(tmp_path, "old"))
    message = str(info.value)
    assert message.startswith("engine 'old': its prepare() returned ") and field in message, message
    assert "row 'a'" in message


@pytest.mark.parametrize(("returned", "field"), [
    (lambda clips: Synthesised([c[None, :] for c in clips], 1, 1), "Synthesised.audio[0] an array of shape"),
    (lambda clips: Synthesised([c.tolist() for c in clips], 1, 1), "Synthesised.audio[0] [0.0"),
    (lambda clips: Synthesised(clips[:0], 1, 1), "Synthesised.audio of 0 clips for 1 pieces"),
    (lambda clips: Synthesised(clips, "1", 1), "Synthesised.real_frames '1' (a str)"),
    (lambda clips: Synthesised(clips, 1, 1, lm=5), "Synthesised.lm 5"),
    (lambda clips: (clips, 1, 1), "not a Synthesised"),
])
def test_a_synthesised_of_the_wrong_shape_fails_the_batchs_rows(tmp_path, returned, field):
    @register_engine
    class Bad(Base):
        name = "bad"

        def synthesize(self, units):
            return returned(super().synthesize(units).audio)

    result = run(job(tmp_path, "bad"))
    assert result.stats["items_failed"] == 2
    reasons = [json.loads(x)["reason"] for x in (tmp_path / "out" / "failures.jsonl").read_text().splitlines()]
    assert all(r.startswith("engine 'bad': its synthesize() returned ") and field in r for r in reasons), reasons


def test_a_right_shaped_engine_still_runs(tmp_path):
    @register_engine
    class Good(Base):
        name = "good"

    assert run(job(tmp_path, "good")).stats["items_done"] == 2
