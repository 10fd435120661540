"""`--plan-only` (and a run) must not grow with the corpus (issue 31, hole 10): espeak-ng allocated
about 1.3 KB of native memory on every espeak_SetVoiceByName and never freed it, and the Piper
engine set the voice once per row, so planning 200k rows grew by hundreds of MB. The whole-plan
figure is benchmarks/plan_memory.py's; here the mechanism, in a fresh process (RSS, native memory
included). The rest of the growth was piper-tts's `espeakbridge.get_phonemes`, which keeps a
reference to every clause tuple it returns (about 200 B a clause, on every call, new text or not):
the Piper engine now calls espeak-ng itself, and must still get what the bridge gives."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers import ROOT

PROBE = textwrap.dedent("""
    from cosybatch.engines.piper.phonemes import espeak_clauses

    def rss_kb():
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS"))

    for _ in range(2000):  # warm up: espeak's voice, its dictionaries, Python's pools
        espeak_clauses("en-us", "The cat sat on the mat.")
    before = rss_kb()
    for _ in range(8000):
        espeak_clauses("en-us", "The cat sat on the mat.")
    print(rss_kb() - before)
""")


def test_phonemising_the_same_voice_again_and_again_stays_flat():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          check=True)
    grew_kb = int(proc.stdout.split()[-1])
    assert grew_kb < 2048, f"RSS grew {grew_kb} KB over 8000 rows"  # before the fix: about 10 MB


def test_a_voice_change_is_still_applied():
    from cosybatch.engines.piper.phonemes import espeak_clauses

    english = espeak_clauses("en-us", "Hallo Welt.")
    german = espeak_clauses("de", "Hallo Welt.")
    assert german != english and espeak_clauses("en-us", "Hallo Welt.") == english


DISTINCT = textwrap.dedent("""
    import random
    from cosybatch.engines.piper.phonemes import espeak_clauses

    def rss_kb():
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS"))

    rnd = random.Random(0)
    def text():  # three clauses, one made-up word: no two alike
        word = "".join(rnd.choice("bcdfghklmnprstvz") + rnd.choice("aeiou") for _ in range(3))
        return f"The cat sat on the mat, and then it slept. The {word} said so!"

    for _ in range(1000):  # warm up: espeak's dictionaries, Python's pools
        espeak_clauses("en-us", text())
    before = rss_kb()
    for _ in range(6000):
        espeak_clauses("en-us", text())
    print(rss_kb() - before)
""")


def test_phonemising_distinct_texts_stays_flat():
    proc = subprocess.run([sys.executable, "-c", DISTINCT], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          check=True)
    grew_kb = int(proc.stdout.split()[-1])
    # before the fix: about 3.8 MB (18,000 clause tuples the bridge never freed); after: flat
    assert grew_kb < 1024, f"RSS grew {grew_kb} KB over 6000 distinct texts"


def test_espeak_clauses_match_the_bridge():
    """The clauses, terminators and sentence ends are piper-tts's `get_phonemes`', text for text."""
    from piper import espeakbridge

    from cosybatch.engines.piper import phonemes

    texts = ["The cat sat on the mat.", "a, b; c: d? e! f.", "Hello", "", "   ", "(x) ... -- 'q' \"r\"",
             "Dr. Smith paid $3.50 on 1/2/2024, at 10:30.", "日本語 text é ü ß", "✓", "Wait... what?! No; yes: maybe."]
    for voice in ("en-us", "de", "fr"):
        phonemes.espeak_clauses(voice, "")  # sets espeak's voice, through the bridge
        assert phonemes._TEXT_TO_PHONEMES is not None  # the leak-free path is the one taken
        for text in texts:
            with phonemes._ESPEAK_LOCK:
                assert phonemes._espeak_phonemes(phonemes._TEXT_TO_PHONEMES, text) == espeakbridge.get_phonemes(text)
