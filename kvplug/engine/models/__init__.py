"""Real-model example engine: a tiny transformer whose attention reads and writes kvplug pools.

``TinyModel`` plugs into ``kvplug.engine.scheduler`` as its model; ``reference_logits`` /
``reference_generate`` recompute densely without any cache, the oracle the tests compare with.
"""

from .reference import reference_generate, reference_logits
from .tiny import LayerWeights, TinyConfig, TinyModel

__all__ = ["LayerWeights", "TinyConfig", "TinyModel", "reference_generate", "reference_logits"]
