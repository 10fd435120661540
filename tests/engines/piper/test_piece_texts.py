"""What each Piper piece says (Piece.text, for KEY.json "segments"): espeak-ng gives no offsets, so
the text is cut at its clause punctuation and matched to espeak's clauses."""

from __future__ import annotations

from cosybatch.engines import EngineOptions, VoiceRequest
from cosybatch.engines.piper.engine import PiperEngine, PiperOptions
from cosybatch.engines.piper.text import clause_spans


def _texts(text: str, **opts) -> list:
    engine = PiperEngine(None, EngineOptions(engine=PiperOptions(**opts)))
    return [p.text for p in engine.prepare(text, "x", VoiceRequest()).pieces]


def test_each_sentence_is_a_piece_with_its_words():
    # Clauses of one sentence share its piece; abbreviations espeak reads inside a clause ("St.",
    # "e.g.") do not cut it, and where espeak ends a sentence ("Dr." is "doctor." to it) so does the text.
    assert _texts('"Are you coming?" asked Maya. Dr. Patel lives on Elm St. near us. Herbs, e.g. basil, grow.') == [
        '"Are you coming?"', "asked Maya.", "Dr.", "Patel lives on Elm St. near us.", "Herbs, e.g. basil, grow."]


def test_a_clause_cut_at_words_has_no_text():
    long = "Then " + " ".join(["word"] * 60) + "."  # (espeak reads on past a full stop before a lowercase word)
    texts = _texts(f"Short one. {long} Last one.", max_piece_ids=40)
    assert texts[0] == "Short one." and texts[-1] == "Last one."
    assert len(texts) > 3 and all(t is None for t in texts[1:-1])


def test_clause_spans():
    text = "One, two. Dr. Who is here. Three"
    size = len  # a stand-in for the phoneme count of a text alone
    # As many pieces of punctuation as clauses: taken as they are.
    assert [text[a:b] for a, b in clause_spans(text, [3, 3, 2, 10, 5], size)] == [
        "One,", "two.", "Dr.", "Who is here.", "Three"]
    # Fewer clauses (espeak read "Dr." inside one): merged where the sizes say.
    assert [text[a:b] for a, b in clause_spans(text, [9, 16, 5], size)] == ["One, two.", "Dr. Who is here.", "Three"]
    assert clause_spans(text, [1] * 6, size) is None  # more clauses than the punctuation cuts: unknown
