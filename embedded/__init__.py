"""The embedded model's tooling: the trainer, split by concern, and the probes that only make sense on the
synthetic scenes it is trained on (docs/embedded.md).

- ``recipe.py``      the recipe: every setting that decides the weights (the shipped one is
                     ``rcr/embedded_model/recipe.json``), validated, with the fields each stage depends on
- ``assets.py``      tokenizer, processor and chat template, model sizes, the saved model directory
- ``sink.py``        the attention sink held in the weights through training
- ``curriculum.py``  the deterministic batch plan (task mix, scenes, canvas) and the learning-rate schedules
- ``batches.py``     synthetic samples as training batches (the processor's output, grounding targets)
- ``losses.py``      cross-entropy + grounding loss, the optimizer and its step
- ``loops.py``       the main and polish stages' loops, run options
- ``vision.py``      the vision stage (the tower alone, on single objects)
- ``checkpoints.py`` checkpoints, and how saved weights compare with a reference
- ``train.py``       one run, stage after stage; ``cli.py`` its command line (``jobs/train_embedded.py``)
- ``probes/``        what the embedded model reads of its scenes, and the premises per kind of scene
"""
