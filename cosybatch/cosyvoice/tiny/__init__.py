"""Write a CosyVoice model folder in the official layout with random weights, for any family.

Model weights cannot be downloaded everywhere, so the tests, the benchmarks and anyone trying
cosybatch without the real model use a folder written here. Layout, file formats and key names
are those of the official downloads (CosyVoice-300M, CosyVoice2-0.5B, Fun-CosyVoice3-0.5B); the
sizes are small and the weights random, so the speech is noise. Same arguments, same bytes.

    python -m cosybatch.cosyvoice.tiny --family v1|v2|v3 [--variant base|sft|instruct] [--size tiny|real]
                                       [--seed N] [--short] DIR

In Python: ``write_model_dir(out, family="v1", variant="sft")``. One module per family
(:mod:`.v1`, :mod:`.v2`, :mod:`.v3`); :mod:`.assets` writes the ONNX models and the
``CosyVoice-BlankEN/`` folder, :mod:`.random_weights` the shared weight helpers. Nothing in the
runtime imports this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import v1, v2, v3

# Per family: the writer and the options it takes (besides the output folder).
WRITERS = {
    "v1": (v1.write_model_dir, ("variant", "size", "seed", "speakers", "llm", "short")),
    "v2": (v2.write_model_dir, ("size", "seed", "speakers", "llm", "short")),
    "v3": (v3.write_model_dir, ("seed", "parts")),
}
FAMILIES = tuple(WRITERS)


def write_model_dir(out: str | Path, *, family: str = "v2", **options: Any) -> Path:
    """Write ``family``'s folder at ``out`` (the folder's name is what says a v1 folder's variant:
    name it ``...-SFT`` or ``...-Instruct``); returns its path. ``options``: the family's writer's
    (v1: variant, size, seed, speakers, llm, short; v2: size, seed, speakers, llm, short; v3: seed, parts).
    v3 takes no ``short``: its random decoder already ends rows early (any of its 200 control ids
    stops a row)."""
    if family not in WRITERS:
        raise ValueError(f"family {family!r}: choose one of {', '.join(FAMILIES)}")
    writer, accepted = WRITERS[family]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"family {family}: no option {', '.join(unknown)} (it takes {', '.join(accepted)})")
    return writer(out, **options)
