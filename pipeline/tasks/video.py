"""Video: a description of a short video given as frames (local videos through ``jobs/prepare_data.py video``,
or the embedded synthetic clips of moving shapes)."""

from pipeline.tasks.base import Task, register

VIDEO = register(Task(
    name="video",
    prompt="Describe what happens in this video.",
    max_new_tokens=128,
    media="video",
    embedded_size=100,
))
