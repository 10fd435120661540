"""The CosyVoice engine adapter: rows -> segments (:mod:`.engine`'s ``prepare``), segments -> audio
(``synthesize``, which runs :mod:`cosybatch.cosyvoice.pipeline`), and the setup checks of
``run --check`` (:mod:`.setup`). The models themselves live in :mod:`cosybatch.cosyvoice`.

Importing this package imports neither torch nor onnxruntime; the engine does when it loads.
"""

from .engine import CosyVoiceEngine, CosyVoiceOptions
from .setup import check_flow_backend, check_setup

__all__ = ["CosyVoiceEngine", "CosyVoiceOptions", "check_flow_backend", "check_setup"]
