"""``rcr`` inside lmms-eval: a model backend and local caption tasks (docs/lmms_eval.md).

lmms-eval finds the model through its entry-point group ``lmms_eval.models`` (pyproject.toml), which names
:func:`manifest`. This module stays light: lmms-eval loads every entry point whenever it starts, whichever
model it is asked for, so the model itself (``pipeline/lmms/model.py``, which imports torch, transformers and
``rcr``) is imported only when ``--model rcr`` is run.
"""

from __future__ import annotations

MODEL_ID = "rcr"
MODEL_CLASS = "pipeline.lmms.model.RCRModel"


def manifest():
    """lmms-eval's registration payload for ``--model rcr``: a simple (text + visuals) model."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path=MODEL_CLASS)
