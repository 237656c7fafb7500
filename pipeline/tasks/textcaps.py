"""TextCaps: a one-sentence caption of one image (BACON's lmms-eval config ``textcaps_val_local``: its prompt,
64 new tokens, split ``val``).

Data: ``lmms-lab/TextCaps`` (later renamed ``lmms-lab-encoder/TextCaps``), split ``val``, files
``data/val-0000K-of-00002.parquet``; the image is a ``datasets`` Image struct in ``image`` and the references are
in ``caption_str``. Rows that share an ``image_id`` are one sample with all their captions.
"""

from pipeline.tasks.base import HubSource, Task, register

TEXTCAPS = register(Task(
    name="textcaps",
    prompt="Provide a one-sentence caption for the provided image.",
    max_new_tokens=64,
    source=HubSource(
        repo_id="lmms-lab/TextCaps",
        revision="09a9d5e2f0829b732faf722b8c4a9c2e9ef9e575",
        split="val",
        files=("data/val-00000-of-00002.parquet", "data/val-00001-of-00002.parquet"),
        image_column="image",
        reference_columns=("caption_str",),
        id_column="image_id",
    ),
    embedded_size=500,
))
