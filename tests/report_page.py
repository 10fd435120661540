"""Shared by the report page's tests: rows with real WAV clips, and a small DOM reader of the page."""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field
from html.parser import HTMLParser

import numpy as np
import soundfile as sf

SR = 22050
HOSTILE_ID = '<script>alert("id")</script>&\'x'
HOSTILE_TEXT = "\"><img src=x onerror=alert(1)> & <b>bold</b> 'quoted'"


def sine_wav(seconds: float, freq: float = 440.0) -> bytes:
    """A sine burst with a short fade at both ends, 22050 Hz 16-bit PCM mono."""
    t = np.arange(round(seconds * SR)) / SR
    audio = 0.3 * np.sin(2 * np.pi * freq * t) * np.minimum(1, np.minimum(t, t[::-1]) / 0.01)
    buf = io.BytesIO()
    sf.write(buf, audio.astype(np.float32), SR, subtype="PCM_16", format="WAV")
    return buf.getvalue()


def make_rows(
    n: int, *, seed: int = 1, hostile: bool = False, asr: bool = True, audio: bool = True
) -> tuple[list[dict], dict[str, bytes]]:
    """n rows of every kind (passed, flagged, failed; three voices), distinct scores, and (audio=True)
    the WAV of each: sine bursts of 0.4 to 3.4 s. With hostile=True the first row's id and text are
    hostile."""
    rng = random.Random(seed)
    rows, wavs = [], {}
    for i in range(n):
        words = i % 13 + 1
        duration = round(0.4 + 0.04 * (i % 76), 3)
        rid = HOSTILE_ID if hostile and i == 0 else f"row-{i:04d}"
        flags = ["slow"] if i % 5 == 0 else (["long_silence", "slow"] if i % 11 == 0 else [])
        rows.append(
            {
                "id": rid,
                "text": HOSTILE_TEXT if hostile and i == 0 else " ".join(["word"] * words),
                "voice": ("en_US-lessac-medium", "en_GB-alba-medium", "de_DE-thorsten-low")[i % 3],
                "duration_s": duration,
                "units": 5 * words,
                "qc_pass": i % 7 != 0,
                "qc_flags": flags,
                "qc_cer": (rng.random() * 0.5 if i % 4 else 1.2) if asr else None,
                "qc_wer": rng.random() if asr else None,
                "qc_asr_text": f"heard {i}" if asr else None,
                "qc_attempts": 1 + i % 3,
                "qc_score": rng.random() * 5,
            }
        )
        if audio:
            wavs[rid] = sine_wav(duration, 220 + 7 * (i % 50))
    return rows, wavs


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    ancestors: list[Element]
    text: str = ""
    children: list[Element] = field(default_factory=list)

    def within(self, element_id: str) -> bool:
        return any(a.attrs.get("id") == element_id for a in self.ancestors)


class _Reader(HTMLParser):
    VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "source", "wbr"})

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self.stack: list[Element] = []

    def handle_starttag(self, tag, attrs):
        element = Element(tag, {k: v or "" for k, v in attrs}, list(self.stack))
        self.elements.append(element)
        if self.stack:
            self.stack[-1].children.append(element)
        if tag not in self.VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop().tag == tag:
                break

    def handle_data(self, data):
        for element in self.stack:
            element.text += data


class Page:
    """The elements of an HTML page, with a few selectors the tests need."""

    def __init__(self, text: str):
        reader = _Reader()
        reader.feed(text)
        reader.close()
        self.elements = reader.elements

    def find(self, tag: str, within: str | None = None, **attrs: str) -> list[Element]:
        """Elements of `tag` (inside the element with id `within`), whose attributes include `attrs`
        (an underscore in a name stands for a dash; class_ matches one of the classes)."""
        out = []
        for e in self.elements:
            if e.tag != tag or (within and not e.within(within)):
                continue
            ok = True
            for name, value in attrs.items():
                name = name.rstrip("_").replace("_", "-")
                if name == "class":
                    ok &= value in e.attrs.get("class", "").split()
                else:
                    ok &= e.attrs.get(name) == value
            if ok:
                out.append(e)
        return out

    def by_id(self, element_id: str) -> Element | None:
        return next((e for e in self.elements if e.attrs.get("id") == element_id), None)
