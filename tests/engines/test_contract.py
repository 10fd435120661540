"""The engine contract (issue 22): an abstract Engine refused before its model loads, clear errors
for a check/describe that returns no dict or crashes, Prepared as one tuple of pieces, the optional
quantize capability, CLI aliases declared by the engines, `run --help` in panels, doctor's wording
(the python blocks of docs/writing-an-engine.md run in tests/docs)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cosybatch.engines import (
    Alias,
    Engine,
    EngineOptions,
    Piece,
    Prepared,
    Synthesised,
    engine_aliases,
    engine_check,
    engine_class,
    open_engine,
    quantize,
    register_engine,
)
from cosybatch.engines import registry as registry_module
from cosybatch.errors import EngineError, UsageError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def only_this_tests_engines(monkeypatch):
    """In-process registrations last for one test."""
    monkeypatch.setattr(registry_module, "_IN_PROCESS", {})


@dataclass(frozen=True)
class FakeOptions:
    loudness: float = 0.5
    """Peak of the clip before the job normalises it."""


class Fake(Engine):
    """A complete engine: one piece per row, 10 samples per character."""

    name = "fake"
    Options = FakeOptions
    aliases = (Alias("loudness", float, "peak of each clip."),)

    def __init__(self, voice, options):
        self.sample_rate, self.device, self.voice_name = 8000, "cpu", voice or "fake"
        self.loudness = options.engine.loudness

    def describe(self):
        return {"loudness": self.loudness}

    def prepare(self, text, item_id, voice):
        return Prepared((Piece(cost=len(text), payload=len(text)),), text)

    def synthesize(self, units):
        clips = [np.full(10 * u.payload, self.loudness, dtype=np.float32) for u in units]
        return Synthesised(clips, real_frames=sum(map(len, clips)), padded_frames=max(map(len, clips)) * len(clips))


def test_an_engine_missing_an_abstract_method_is_refused_before_its_model_loads():
    loaded = []

    class NoDescribe(Engine):
        name = "nodescribe"

        def __init__(self, voice, options):
            loaded.append(voice)  # would load the model

        def prepare(self, text, item_id, voice):
            raise AssertionError

        def synthesize(self, units):
            raise AssertionError

    with pytest.raises(UsageError, match=r"engine 'nodescribe' .* does not implement describe"):
        register_engine(NoDescribe)
    with pytest.raises(UsageError, match="does not implement describe"):
        registry_module._checked("nodescribe", "pkg:NoDescribe", NoDescribe)  # what an entry point gets
    assert loaded == []


def test_a_complete_engine_opens_in_process_and_fingerprints():
    register_engine(Fake)
    assert engine_class("fake") is Fake
    engine = open_engine("fake", None, EngineOptions())
    assert engine.fingerprint() == {"engine": "fake", "device": "cpu", "loudness": 0.5}
    prepared = engine.prepare("abc", "row-1", None)
    assert prepared.pieces == (Piece(3, 3),)
    # check is a classmethod; the default returns the voice it was given, as a dict
    assert engine_check(Fake, "v", EngineOptions(engine=FakeOptions())) == {"voice": "v"}


@pytest.mark.parametrize(("returned", "shown"), [(None, "None"), ("alice", "'alice'"), (["x"], r"\['x'\]")])
def test_a_check_that_returns_no_dict_names_the_engine_and_what_it_returned(returned, shown):
    class Bad(Fake):
        name = "badcheck"

        @classmethod
        def check(cls, voice, options):
            return returned

    with pytest.raises(EngineError, match=rf"engine 'badcheck': its check\(\) returned {shown}, not a dict"):
        engine_check(Bad, None, EngineOptions(engine=FakeOptions()))


def test_a_check_that_crashes_names_the_engine_and_the_exception():
    class Crashing(Fake):
        name = "crashing"

        @classmethod
        def check(cls, voice, options):
            return options.engine.no_such_field  # AttributeError

    with pytest.raises(EngineError, match=r"engine 'crashing': its check\(\) raised AttributeError") as err:
        engine_check(Crashing, None, EngineOptions(engine=FakeOptions()))
    assert "internal error" not in str(err.value)


def test_a_refusal_from_check_is_the_engines_own_usage_error():
    class Refusing(Fake):
        name = "refusing"

        @classmethod
        def check(cls, voice, options):
            raise UsageError(f"voice {voice!r}: no such voice")

    with pytest.raises(UsageError, match=r"^voice 'x': no such voice$"):
        engine_check(Refusing, "x", EngineOptions(engine=FakeOptions()))


def test_a_describe_that_returns_none_names_the_engine():
    class Silent(Fake):
        name = "silent"

        def describe(self):
            return None

    register_engine(Silent)
    engine = open_engine("silent", None, EngineOptions())
    with pytest.raises(EngineError, match=r"engine 'silent': its describe\(\) returned None"):
        engine.fingerprint()


def test_run_check_reports_a_broken_check_clearly(tmp_path):
    """Through the job's own `run --check` path (in process: the engine is registered here only)."""
    from cosybatch.config import RunConfig
    from cosybatch.run import preflight

    class NoneCheck(Fake):
        name = "nonecheck"

        @classmethod
        def check(cls, voice, options):
            return None

    register_engine(NoneCheck)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "hello"}\n')
    with pytest.raises(EngineError, match=r"engine 'nonecheck': its check\(\) returned None"):
        preflight.check(RunConfig.from_options(corpus=corpus, out=tmp_path / "out", engine="nonecheck", device="cpu"))


def test_quantize_is_an_optional_capability():
    register_engine(Fake)
    with pytest.raises(UsageError, match=r"engine 'fake' has no quantize step; engines that have one: .*piper"):
        quantize("fake", None, {})

    class Quantizing(Fake):
        name = "quantizing"

        @classmethod
        def quantize(cls, voice, options):
            return {"voice": voice, "loudness": options.engine.loudness}

    register_engine(Quantizing)
    assert quantize("quantizing", "v", {"loudness": "0.25"}) == {"voice": "v", "loudness": 0.25}


def test_aliases_come_from_the_engines():
    register_engine(Fake)
    found = engine_aliases()
    assert [name for name, _ in found["loudness"]] == ["fake"]
    # the built-ins declare the flags cli.py used to hard-code
    piper = {a.option for a in engine_class("piper").aliases}
    cosy = {a.option for a in engine_class("cosyvoice").aliases}
    assert piper == {"voice_dir", "speaker", "precision", "noise_scale", "length_scale", "noise_w"}
    assert cosy == {"model", "speaker", "prompt_wav", "prompt_text", "prompt_dir", "instruct", "precision",
                    "max_instruct_chars", "max_prompt_text_chars", "speed"}


def test_an_alias_flag_sets_its_engine_option():
    from cosybatch.config import RunConfig

    cfg = RunConfig.from_options(corpus=Path("c.jsonl"), engine_opt=["speaker=1"], voice_dir=Path("voices"),
                                 speaker="2")
    assert cfg.engine.options == {"speaker": "2", "voice_dir": Path("voices")}  # the alias wins over --engine-opt


def _run_help() -> str:
    from typer.testing import CliRunner

    from cosybatch.cli import app

    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def test_run_help_is_in_panels_and_shows_bracketed_text():
    text = _run_help()
    panels = re.findall(r"╭─ (\w+) ─", text)
    assert panels[-6:] == ["Input", "Engine", "Batching", "Output", "Quality", "Operations"]
    assert "`[engine_options]` in a job spec" in text  # was rendered as ``, read as rich markup
    assert "[default: out/CORPUS-STEM]" in text
    assert "[default: 20000]" in text  # defaults shown


def test_precision_help_points_at_the_piper_page():
    text = " ".join(_run_help().split())
    assert 'docs/piper.md, "INT8 voices"' in text
    assert "README" not in text.split("--precision", 1)[1].split("--", 1)[0]


def test_doctor_says_which_package_holds_onnxruntime(monkeypatch):
    """Newcomer defect 7: "onnxruntime 1.32.0 from onnxruntime 1.32.0"."""
    import onnxruntime

    from cosybatch import doctor, gpu

    monkeypatch.setattr(gpu, "onnxruntime_distributions", lambda: [("onnxruntime", onnxruntime.__version__)])
    line = next(s for s in doctor.describe(doctor.diagnose()).splitlines() if s.startswith("onnxruntime "))
    assert f"from onnxruntime {onnxruntime.__version__}" not in line
    assert line.startswith(f"onnxruntime {onnxruntime.__version__}, installed as onnxruntime")
    both = [("onnxruntime", onnxruntime.__version__), ("onnxruntime-gpu", "1.0.0")]
    monkeypatch.setattr(gpu, "onnxruntime_distributions", lambda: both)
    line = next(s for s in doctor.describe(doctor.diagnose()).splitlines() if s.startswith("onnxruntime "))
    assert "its files from onnxruntime " in line and "onnxruntime-gpu 1.0.0" in line


def test_the_cli_imports_no_engine_runtime():
    code = ("import sys, cosybatch.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'onnxruntime', 'onnx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
