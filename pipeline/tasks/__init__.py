"""The tasks, one file each: ``detailcaps``, ``textcaps``, ``video``. Each module registers its
:class:`~pipeline.tasks.base.Task`; every other part of the pipeline (the input schema, the job's defaults and
``--help``, the dataset converters, the embedded shards, the lmms-eval tasks) reads them from ``TASKS``.
Adding a task is one file here plus its import below, or, from a package of one's own, an entry point in the group
``rcr.tasks`` (docs/extending.md)."""

from pipeline.tasks import detailcaps, textcaps, video  # noqa: F401 - each registers its task
from pipeline.tasks.base import TASKS, HubSource, Task, load_entry_points, register
from pipeline.tasks.detailcaps import DETAILCAPS
from pipeline.tasks.textcaps import TEXTCAPS
from pipeline.tasks.video import VIDEO

load_entry_points()  # installed packages' tasks (entry point group "rcr.tasks")

__all__ = ["TASKS", "Task", "HubSource", "register", "load_entry_points", "DETAILCAPS", "TEXTCAPS", "VIDEO"]
