"""Symbols in text (issue 14, point 7): emoji and pictographs are removed, symbols with a spoken form
are read. For English voices each becomes its English words; other languages leave them to espeak-ng."""

from __future__ import annotations

import itertools
import json
import unicodedata

import pytest

from cosybatch.engines import EngineOptions, RowRejected, open_engine
from cosybatch.engines.piper.phonemes import espeak_clauses
from cosybatch.engines.piper.text import (
    ENGLISH_SYMBOLS,
    SPOKEN_SYMBOLS,
    foreign_letters,
    is_emoji,
    normalize_symbols,
)
from cosybatch.engines.piper.voice import VoiceConfig, bundled_voice

# Every symbol of the English table, and the patterns around it: what the text becomes.
ENGLISH = [
    ("Water boils at 100°C.", "Water boils at 100 degrees Celsius."),
    ("Water boils at 212 °F.", "Water boils at 212 degrees Fahrenheit."),
    ("It was -1°C at night.", "It was -1 degree Celsius at night."),
    ("Absolute zero is 0°K.", "Absolute zero is 0 degrees Kelvin."),
    ("New York lies at 40.7°N, 74°W.", "New York lies at 40.7 degrees north, 74 degrees west."),
    ("A right angle is 90°.", "A right angle is 90 degrees."),
    ("Set the dial to ° marks.", "Set the dial to degrees marks."),
    ("It was 20℃ and 68℉.", "It was 20 degrees Celsius and 68 degrees Fahrenheit."),
    ("The result is 5 ± 2 units.", "The result is 5 plus or minus 2 units."),
    ("An error of (±0.5) mm.", "An error of (plus or minus 0.5) mm."),
    ("Take x ∓ y.", "Take x minus or plus y."),
    ("A 3×3 grid.", "A 3 times 3 grid."),
    ("6 ÷ 2 is 3.", "6 divided by 2 is 3."),
    ("It is ≈ 5 km.", "It is approximately 5 km."),
    ("We need x ≠ 0.", "We need x not equal to 0."),
    ("Keep x ≤ 5 and y ≥ 2.", "Keep x less than or equal to 5 and y greater than or equal to 2."),
    ("Keep x ⩽ 5 and y ⩾ 2.", "Keep x less than or equal to 5 and y greater than or equal to 2."),
    ("Acme™ sells it.", "Acme trademark sells it."),
    ("Text ©2024 Acme.", "Text copyright 2024 Acme."),
    ("Acme® Inc.", "Acme registered Inc."),
    ("See §3.", "See section 3."),
    ("See §§ 4-5.", "See sections 4-5."),
    ("See ¶ 2.", "See paragraph 2."),
    ("Room № 5.", "Room number 5."),
    ("Salinity is 35‰.", "Salinity is 35 per mille."),
    ("A 5 µm filter.", "A 5 micro m filter."),
    ("A 5 μg dose.", "A 5 micro g dose."),
    ("It costs $5.", "It costs 5 dollars."),
    ("It costs $1.", "It costs 1 dollar."),
    ("It costs $5.50.", "It costs 5 dollars and 50 cents."),
    ("It costs $1.01.", "It costs 1 dollar and 1 cent."),
    ("It costs $0.99.", "It costs 99 cents."),
    ("It costs $1,000.", "It costs 1,000 dollars."),
    ("A $5m deal and a $1.5 billion one.", "A 5 million dollars deal and a 1.5 billion dollars one."),
    ("A loss of -$5.", "A loss of -5 dollars."),
    ("It costs €20.", "It costs 20 euros."),
    ("It costs 20€ or 20 €.", "It costs 20 euros or 20 euros."),
    ("It costs £5.50.", "It costs 5 pounds and 50 pence."),
    ("It costs ¥100.", "It costs 100 yen."),
    ("It costs ₹50.", "It costs 50 rupees."),
    ("Significant at p < 0.05 with n>10.", "Significant at p less than 0.05 with n greater than 10."),
]


@pytest.mark.parametrize(("text", "spoken"), ENGLISH, ids=[t for t, _ in ENGLISH])
def test_english_voices_read_symbols(text, spoken):
    assert normalize_symbols(text, english=True) == spoken


def test_every_symbol_of_the_table_is_listed_above():
    listed = "".join(text for text, _ in ENGLISH)
    assert [symbol for symbol in ENGLISH_SYMBOLS if symbol not in listed] == []


@pytest.mark.parametrize("text", ["a <- b", "x << 2", "<b>bold</b>", "50% of A & B", "C# and F#", "10 - 5 = 5",
                                  "US$5 is read by espeak", "No symbols here."])
def test_english_text_without_a_spoken_form_is_left_alone(text):
    assert normalize_symbols(text, english=True) == text


@pytest.mark.parametrize("symbol", sorted(SPOKEN_SYMBOLS))
def test_other_languages_keep_symbols_for_espeak(symbol):
    text = f"100{symbol} ± 2 × 3 ≈ $5"
    assert normalize_symbols(text, english=False) == text
    assert normalize_symbols("20℃", english=False) == "20°C"  # the form espeak-ng reads


EMOJI = ["😀", "👍🏽", "🇺🇸", "❤️", "👨‍👩‍👧", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "⭐", "☀️", "✅", "🫨", "🩷"]


@pytest.mark.parametrize("emoji", EMOJI)
@pytest.mark.parametrize("english", [True, False], ids=["english", "other"])
def test_emoji_are_removed_and_the_text_stays(emoji, english):
    assert normalize_symbols(f"Good {emoji} news{emoji}!", english) == "Good news!"
    assert normalize_symbols(f"{emoji} Water boils at 100°C. {emoji}", english) == (
        "Water boils at 100 degrees Celsius." if english else "Water boils at 100°C.")


def test_symbols_without_a_spoken_form_are_removed():
    """espeak-ng would spell these out as "symbol 2713"."""
    assert normalize_symbols("✓ done ♪ ■ ⠁ ─", english=True) == "done"
    assert "sɪmbəl" in "".join(p for p, _ in espeak_clauses("en-us", "✓"))


def test_keycaps_keep_their_digit():
    assert normalize_symbols("Press 1️⃣ now", english=True) == "Press 1 now"


def test_emoji_ranges():
    from cosybatch.engines.piper.text import _EMOJI_RANGES

    assert all(a <= b < c for (a, b), (c, _) in itertools.pairwise(_EMOJI_RANGES)), "sorted and disjoint"
    assert all(is_emoji(ch) for ch in "😀🇺🇸🏽\u200d\ufe0f\u20e3©®™")
    assert not any(is_emoji(ch) for ch in "aé°±§€$#*1中")
    assert is_emoji("\U0001FAE8")  # shaking face, Unicode 15: newer than this Python's unicodedata
    assert unicodedata.category("\U0001FAE8") in ("So", "Cn")


def test_micro_and_ordinals_are_no_foreign_letters():
    assert foreign_letters("5 µm", {"LATIN"}) == []
    assert foreign_letters("el 1º de mayo, la 2ª vez", {"LATIN"}) == []
    assert foreign_letters("中文", {"LATIN"}) == ["中", "文"]


def test_the_voice_config_says_whether_a_voice_is_english(tmp_path):
    _, config = bundled_voice()
    assert VoiceConfig.load(config).english
    raw = json.loads(config.read_text())
    raw["espeak"] = {"voice": "de"}
    raw["language"] = {"code": "de_DE", "family": "de"}
    german = tmp_path / "de.onnx.json"
    german.write_text(json.dumps(raw))
    assert not VoiceConfig.load(german).english


def test_the_engine_speaks_and_stores_the_spoken_form(engine):
    prepared = engine.prepare("Water boils at 100°C. 😀", "water")
    assert prepared.text == "Water boils at 100 degrees Celsius."
    celsius = engine.prepare("Water boils at 100 degrees Celsius.", "water")
    assert [list(p.payload.ids) for p in prepared.pieces] == [list(p.payload.ids) for p in celsius.pieces]
    with pytest.raises(RowRejected, match="nothing pronounceable"):
        engine.prepare("😀 👍🏽 ✓", "emoji-only")


def test_a_non_english_voice_leaves_symbols_to_espeak(tmp_path):
    model, config = bundled_voice()
    raw = json.loads(config.read_text())
    raw["espeak"] = {"voice": "de"}
    raw["language"] = {"code": "de_DE", "family": "de"}
    (tmp_path / "de_DE-test.onnx").symlink_to(model)
    (tmp_path / "de_DE-test.onnx.json").write_text(json.dumps(raw))
    german = open_engine("piper", str(tmp_path / "de_DE-test.onnx"), EngineOptions(device="cpu"))
    prepared = german.prepare("Wasser kocht bei 100°C. 😀", "wasser")
    assert prepared.text == "Wasser kocht bei 100°C."
    assert "ɡrˈɑːt" in "".join(p for p, _ in espeak_clauses("de", prepared.text))  # "Grad"
