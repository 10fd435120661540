"""`--plan-only` (and a run) must not grow with the corpus (issue 31, hole 10): espeak-ng allocated
about 1.3 KB of native memory on every espeak_SetVoiceByName and never freed it, and the Piper
engine set the voice once per row, so planning 200k rows grew by hundreds of MB. The whole-plan
figure is benchmarks/plan_memory.py's; here the mechanism, in a fresh process (RSS, native memory
included)."""

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
