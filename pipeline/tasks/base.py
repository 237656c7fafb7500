"""What a task is, and the registry every part of the pipeline reads it from (``pipeline/tasks/__init__.py``
imports one module per task, which registers it)."""

from __future__ import annotations

import types
from dataclasses import dataclass
from importlib.metadata import entry_points

MEDIA = ("image", "video")


@dataclass(frozen=True)
class HubSource:
    """The public dataset a task reads with ``--dataset`` (``pipeline/data/convert.py``), pinned."""

    repo_id: str
    revision: str  # the commit every run reads by default (a later one in the hub cache is named when used)
    split: str  # the default split
    files: tuple[str, ...]  # the default split's files in the repository (for copies with no card, no Hub names)
    image_column: str
    reference_columns: tuple[str, ...]
    id_column: str | None  # rows sharing an id are one sample (TextCaps); None: the row index is the id


@dataclass(frozen=True)
class Task:
    """One kind of sample: its prompt, its output length, its media, and where its data comes from."""

    name: str
    prompt: str  # the user prompt sent with the image(s)
    max_new_tokens: int  # the job's default output length
    media: str = "image"  # "image": one or more images; "video": the frames of one video
    source: HubSource | None = None  # the public dataset of ``--dataset NAME``; None: --shards only
    embedded_size: int = 0  # samples in the embedded synthetic shards (pipeline/data/synthetic.py); 0: none

    def __post_init__(self):
        if self.media not in MEDIA:
            raise ValueError(f"Task {self.name!r}: media must be one of {MEDIA}, got {self.media!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"Task {self.name!r}: max_new_tokens must be an integer >= 1")

    @property
    def video(self) -> bool:
        return self.media == "video"


class Registry(dict):
    """name -> Task, in registration order (the order ``--help`` and the analyses list tasks in)."""

    def register(self, task: Task) -> Task:
        if task.name in self and self[task.name] != task:
            raise ValueError(f"task {task.name!r} is already registered with other settings")
        self[task.name] = task
        return task

    def get_task(self, name: str) -> Task:
        if name not in self:
            raise KeyError(f"unknown task {name!r}; registered tasks: {', '.join(self)}")
        return self[name]


TASKS = Registry()
register = TASKS.register
ENTRY_POINT_GROUP = "rcr.tasks"  # an installed package's tasks: `name = "module:TASK"`, or a module that registers


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Register the tasks that installed packages declare as entry points of ``group``: each names a :class:`Task`,
    or a module that registers its tasks when imported. ``pipeline.tasks`` calls it once on import, so a package's
    task reaches every process of a job (the input schema's check runs in the driver and in Ray's read workers).
    Returns the entry points' names; one that fails to load raises, naming it and its package."""
    names = []
    for ep in entry_points(group=group):
        where = f"entry point {ep.name} = {ep.value} (group {group}, package {ep.dist.name if ep.dist else '?'})"
        try:
            obj = ep.load()
        except Exception as e:
            raise ImportError(f"{where} does not load: {type(e).__name__}: {e}") from e
        if isinstance(obj, Task):
            register(obj)
        elif not isinstance(obj, types.ModuleType):
            raise TypeError(f"{where}: names {obj!r}; it must name a Task or a module")
        names.append(ep.name)
    return names
