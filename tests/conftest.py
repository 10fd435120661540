"""Fixtures only; shared functions live in helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TEXTS


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return list(TEXTS)


@pytest.fixture(scope="session")
def engine():
    """The real bundled voice on CPU, loaded once."""
    from cosybatch.engines import EngineOptions, open_engine

    return open_engine("piper", None, EngineOptions(device="cpu"))


@pytest.fixture(scope="session")
def cosyvoice_dir(tmp_path_factory) -> Path:
    """A tiny CosyVoice2 model directory in the official layout, random weights, written once."""
    from cosybatch.cosyvoice.tiny import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice") / "CosyVoice2-tiny")


@pytest.fixture(scope="session")
def cosyvoice_v1_dir(tmp_path_factory) -> Path:
    """A tiny CosyVoice-300M-SFT folder in the official layout (speakers in spk2info.pt), random weights."""
    from cosybatch.cosyvoice.tiny_v1 import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice-v1") / "CosyVoice-300M-SFT-tiny", variant="sft")


@pytest.fixture(scope="session")
def cosyvoice_v1_instruct_dir(tmp_path_factory) -> Path:
    """A tiny CosyVoice-300M-Instruct folder (its folder name is what says it follows instructions)."""
    from cosybatch.cosyvoice.tiny_v1 import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice-v1i") / "CosyVoice-300M-Instruct-tiny",
                           variant="instruct")


@pytest.fixture(scope="session")
def cosyvoice_v3_dir(tmp_path_factory) -> Path:
    """A tiny Fun-CosyVoice3-0.5B folder in the official layout, random weights."""
    from cosybatch.cosyvoice.tiny_v3 import write_model_dir_v3

    return write_model_dir_v3(tmp_path_factory.mktemp("cosyvoice-v3") / "Fun-CosyVoice3-0.5B-tiny")


@pytest.fixture(scope="session")
def tone():
    """RunConfig for the tone engine (tests/plugin, installed as a plugin): a job's mechanics in
    process, in milliseconds, with no model. tone(corpus, out, **settings) -> RunConfig."""
    from importlib.metadata import entry_points

    from cosybatch.config import RunConfig

    if not any(ep.name == "tone" for ep in entry_points(group="cosybatch.engines")):
        pytest.fail("the test plugin is not installed: pip install --no-deps ./tests/plugin (as .ci/run does)")

    def config(corpus: Path, out: Path, **settings) -> RunConfig:
        return RunConfig(corpus=corpus, out=out, **{"engine": "tone", "progress": "none", **settings})

    return config
