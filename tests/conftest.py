from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Mixed lengths on purpose: durations must grow with text, batches must bucket by length.
TEXTS = [
    "Yes.",
    "Good morning.",
    "The kettle is boiling.",
    "Please close the window before you leave the house.",
    "Rain is expected this afternoon, so bring an umbrella and a warm coat.",
    "The library opens at nine. Returns go in the slot by the door. Late fees are small.",
    "After the long winter, the farmers checked every fence, repaired the old barn roof, and "
    "planted rows of beans, carrots and potatoes along the southern edge of the field.",
    "Why not?",
]


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return list(TEXTS)


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    if gz:
        import gzip

        data = gzip.compress(data)
    path.write_bytes(data)
    return path


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
    from cosybatch.cosyvoice.tiny import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice-v1") / "CosyVoice-300M-SFT-tiny", family="v1",
                           variant="sft")


@pytest.fixture(scope="session")
def cosyvoice_v1_instruct_dir(tmp_path_factory) -> Path:
    """A tiny CosyVoice-300M-Instruct folder (its folder name is what says it follows instructions)."""
    from cosybatch.cosyvoice.tiny import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice-v1i") / "CosyVoice-300M-Instruct-tiny", family="v1",
                           variant="instruct")


@pytest.fixture(scope="session")
def cosyvoice_v3_dir(tmp_path_factory) -> Path:
    """A tiny Fun-CosyVoice3-0.5B folder in the official layout, random weights."""
    from cosybatch.cosyvoice.tiny import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("cosyvoice-v3") / "Fun-CosyVoice3-0.5B-tiny", family="v3")
