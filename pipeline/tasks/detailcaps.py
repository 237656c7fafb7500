"""DetailCaps: a long, detailed description of one image (lmms-eval's ``detailcaps``: its prompt, 512 new tokens).

Data: ``foundation-multimodal-models/DetailCaps-4870``, split ``test`` (4,870 images), one file
``DetailCaps-4870.parquet`` at the repository root; the image bytes are in ``binary`` and the references in
``GT_Caption_GPT4O``, ``GT_Caption_GPT4V`` and ``GT_Caption_Gemini15Pro``.
"""

from pipeline.tasks.base import HubSource, Task, register

DETAILCAPS = register(Task(
    name="detailcaps",
    prompt="Describe this image in detail.",
    max_new_tokens=512,
    source=HubSource(
        repo_id="foundation-multimodal-models/DetailCaps-4870",
        revision="3882c5a37b8971c86d0093838c967083c5f90f9d",
        split="test",
        files=("DetailCaps-4870.parquet",),
        image_column="binary",
        reference_columns=("GT_Caption_GPT4O", "GT_Caption_GPT4V", "GT_Caption_Gemini15Pro"),
        id_column=None,  # rows have no unique id column; the row index in the pinned file is stable
    ),
    embedded_size=300,
))
