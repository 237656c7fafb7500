"""Deterministic synthetic scenes and videos in the project's input schema.

Three task styles, each a pure function of ``(seed, task, index)``:

* ``detailcaps`` -- a 448 x 560 px scene (16 x 20 = 320 visual tokens after the Qwen2-VL merge) on a grid of
  5 rows by 4 columns, with 11-14 small objects. The description walks the occupied cells in raster order
  and gives, per object, its position (row, column), size, colour, texture, shape and a relation to the next
  object. Every object sits in its own cell and shows its attributes only in its own 1-4 visual tokens, and
  a scene has more object tokens than a 32-entry selection holds: which entries a step needs changes as the
  description moves from object to object.
* ``textcaps`` -- the same kind of image with one or two objects and a one-sentence caption
  (<= ~20 tokens): the same long prefix, a short answer that needs only a few entries.
* ``video`` -- 8, 12 or 16 frames of 168 px (36 visual tokens per temporal patch of 2 frames) with one
  or two objects hopping between the 9 positions of a 3x3 grid, described over time ("The red circle
  moves from the top left to the centre , then to the bottom right .").

Descriptions are written in the canonical spaced form that the embedded word-level tokenizer decodes to
("In row two , column one , ..."), so ``decode(encode(text)) == text`` and any ROUGE tokenizer sees the
same tokens in references and model output.

Rendering is plain numpy (no anti-aliasing), so images are bit-identical across machines; PNG encoding
is lossless, so the pixels a model sees after a round trip through a shard are exactly these.
"""

from __future__ import annotations

import io
import re
from dataclasses import replace

import numpy as np

from pipeline.data.scenes import (  # noqa: F401 - the scenes' names are part of this module's interface
    BACKGROUND,
    BIG_RADIUS,
    COLOURS,
    DEFAULT_LAYOUT,
    LAYOUTS,
    SHAPES,
    SIZES,
    SMALL_RADIUS,
    TEXTURES,
    SceneLayout,
    SceneObject,
    SyntheticError,
    blank,
    get_layout,
    paint,
    random_object,
    render_grid,
)
from pipeline.tasks import TASKS as REGISTRY

SOURCE = "synthetic"

NUMBER_WORDS = ("one", "two", "three", "four", "five")



FRAME_SIZE = 168  # 12x12 patches -> 6x6 = 36 merged tokens per temporal patch
VIDEO_GRID = 3
VIDEO_CELL = FRAME_SIZE // VIDEO_GRID
VIDEO_POSITIONS = (
    "the top left", "the top", "the top right",
    "the left", "the centre", "the right",
    "the bottom left", "the bottom", "the bottom right",
)
QUADRANTS = ("the top left", "the top right", "the bottom left", "the bottom right")

HELDOUT_SEED = 10_000  # evaluation and the embedded job's shards use this seed: training refuses it (its recipe)

# the tasks this generator draws, in the order that sets each one's seed offset (never reorder)
TASKS = ("detailcaps", "textcaps", "video")
_TASK_CODE = {t: i + 1 for i, t in enumerate(TASKS)}
_TINT_STREAM = 6  # the random stream of a scene's canvas tint (``scene_tint``), apart from the scene's own


def check_task(task: str) -> str:
    if task not in TASKS:
        raise SyntheticError(f"unknown task {task!r}: field 'task' must be one of {', '.join(TASKS)}")
    return task


# ----------------------------------------------------------------------------------------- text utils
_WORD_RE = re.compile(r"\w+|[^\w\s]")


def canonical(text: str) -> str:
    """Spaced form: every word and every punctuation mark separated by one space."""
    return " ".join(_WORD_RE.findall(text))


def vocabulary() -> list[str]:
    """Every word the grammar (targets and prompts) can produce, sorted."""
    words: set[str] = set()
    fixed = [
        "In row , column , a left of the at the end of its row . nothing",
        "A and at moves from to then stays in the whole time",
        "One object . Two objects . The",
    ]
    fixed += [REGISTRY[t].prompt for t in TASKS] + list(VIDEO_POSITIONS) + list(QUADRANTS)
    fixed += list(COLOURS) + list(SHAPES) + list(SIZES) + list(TEXTURES) + list(NUMBER_WORDS)
    for s in fixed:
        words.update(canonical(s).split())
    return sorted(words)


# ----------------------------------------------------------------------------------------- tasks
def _detailcaps(rng: np.random.Generator, n_objects: int | None, lay: SceneLayout,
                tint: float = 0.0) -> tuple[list[np.ndarray], str]:
    n = int(rng.integers(lay.min_objects, lay.max_objects + 1)) if n_objects is None else n_objects
    n_cells = lay.rows * lay.cols
    if not 1 <= n <= n_cells:
        raise SyntheticError(f"n_objects must be in 1..{n_cells}, got {n}")
    chosen = sorted(rng.choice(n_cells, size=n, replace=False).tolist())
    cells = {cell: random_object(rng) for cell in chosen}
    img = render_grid(rng, cells, lay, tint)
    described = range(n_cells) if lay.every_cell else chosen
    parts = []
    for i, cell in enumerate(described):
        r, c = divmod(cell, lay.cols)
        where = f"In row {NUMBER_WORDS[r]} , column {NUMBER_WORDS[c]} ,"
        if cell not in cells:
            parts.append(f"{where} nothing .")
            continue
        # the object to the right: the next occupied cell of the row (v1, v2) or the neighbouring cell (v3)
        nxt = cell + 1 if lay.every_cell else (chosen[i + 1] if i + 1 < len(chosen) else None)
        if c == lay.cols - 1 or nxt is None or nxt // lay.cols != r:
            rel = " , at the end of its row"
        elif nxt in cells:
            rel = f" , left of the {cells[nxt].short()}"
        else:
            rel = ""  # v3: an empty neighbour is not mentioned
        parts.append(f"{where} a {cells[cell].phrase()}{rel} .")
    return [img], " ".join(parts)


def _textcaps_objects(rng: np.random.Generator, lay: SceneLayout) -> list[tuple[int, SceneObject, int]]:
    """(cell, object, quadrant) of each of a caption's one or two objects, in caption order."""
    n = int(rng.integers(1, 3))
    placed = []
    for q in sorted(rng.choice(4, size=n, replace=False).tolist()):
        qr, qc = divmod(q, 2)
        # a quadrant's two rows/columns nearest its corner (an odd grid's middle row belongs to neither half)
        r = qr * (lay.rows - 2) + int(rng.integers(2))
        c = qc * (lay.cols - 2) + int(rng.integers(2))
        placed.append((r * lay.cols + c, random_object(rng), q))
    return placed


def _textcaps(rng: np.random.Generator, lay: SceneLayout, tint: float = 0.0) -> tuple[list[np.ndarray], str]:
    placed = _textcaps_objects(rng, lay)
    img = render_grid(rng, {cell: obj for cell, obj, _ in placed}, lay, tint)
    text = " and ".join(f"a {obj.phrase()} at {QUADRANTS[q]}" for _, obj, q in placed) + " ."
    return [img], text[0].upper() + text[1:]


def _video(rng: np.random.Generator) -> tuple[list[np.ndarray], str]:
    n_way = int(rng.integers(2, 5))  # 2..4 waypoints -> 8, 12, 16 frames
    n_obj = int(rng.integers(1, 3))
    objs: list[SceneObject] = []
    while len(objs) < n_obj:
        o = SceneObject(shape=SHAPES[rng.integers(len(SHAPES))], colour=list(COLOURS)[rng.integers(len(COLOURS))])
        if all(o.short() != p.short() for p in objs):
            objs.append(o)
    # the second object stays put for the whole clip 30% of the time; otherwise every object moves at
    # every waypoint, and no two objects share a waypoint position
    still = [j == 1 and rng.random() < 0.3 for j in range(n_obj)]
    paths: list[list[int]] = [[] for _ in objs]
    for k in range(n_way):
        taken: set[int] = set()
        for j in range(n_obj):
            if still[j] and k > 0:
                pos = paths[j][0]
            else:
                while True:
                    pos = int(rng.integers(9))
                    if pos in taken or (paths[j] and pos == paths[j][-1]):
                        continue
                    if still[j] and any(pos in paths[i] for i in range(j)):
                        continue
                    break
            taken.add(pos)
            paths[j].append(pos)

    def centre(pos: int) -> np.ndarray:
        r, c = divmod(pos, VIDEO_GRID)
        return np.array([c * VIDEO_CELL + VIDEO_CELL // 2, r * VIDEO_CELL + VIDEO_CELL // 2], dtype=np.float32)

    frames = []
    for k in range(n_way):
        # frames 4k, 4k+1 at waypoint k; frames 4k+2, 4k+3 half-way to waypoint k+1 (or still there, last)
        for sub in range(4):
            img = blank(FRAME_SIZE)
            for j, obj in enumerate(objs):
                p = centre(paths[j][k])
                if sub >= 2 and k + 1 < n_way:
                    p = (p + centre(paths[j][k + 1])) / 2
                paint(img, int(p[0]), int(p[1]), obj, 18.0)
            frames.append(img)
    sentences = []
    for j, obj in enumerate(objs):
        path = paths[j]
        if still[j]:
            sentences.append(f"The {obj.short()} stays in {VIDEO_POSITIONS[path[0]]} the whole time .")
            continue
        steps = [f"to {VIDEO_POSITIONS[b]}" for b in path[1:]]
        sentences.append(f"The {obj.short()} moves from {VIDEO_POSITIONS[path[0]]} " + " , then ".join(steps) + " .")
    return frames, " ".join(sentences)


# ------------------------------------------------------------------------------ reading a description back
def described_cells(words: list[str]) -> list[tuple[int, int] | None]:
    """Per word k of a tokenised detailcaps description, the (row, column) that the words before it last named
    ("In row two , column three ," -> (1, 2) from the word after "three" on); None before the first. The step
    that writes word k reads them."""
    number = {w: i for i, w in enumerate(NUMBER_WORDS)}
    out, row, cell = [], None, None
    for k, w in enumerate(words):
        out.append(cell)
        if k and w in number and words[k - 1] == "row":
            row = number[w]
        elif k and w in number and words[k - 1] == "column" and row is not None:
            cell = (row, number[w])
    return out


PHRASE_ATTRIBUTES = 4  # the words after an object phrase's "a": size, colour, texture, shape (SceneObject.phrase)


def object_phrases(words: list[str]) -> list[int]:
    """Indices of the "a" (or a caption's "A") that opens each object phrase, "a <size> <colour> <texture>
    <shape>", in a tokenised description or caption."""
    n = PHRASE_ATTRIBUTES
    return [i for i, w in enumerate(words) if w.lower() == "a" and i + n < len(words) and words[i + n] in SHAPES]


def attribute_words(words: list[str]) -> list[int]:
    """Indices of the size, colour, texture and shape words of every object phrase: the words only the object's
    own pixels tell."""
    return [i + off for i in object_phrases(words) for off in range(1, PHRASE_ATTRIBUTES + 1)]


def textcaps_cells(seed: int, index: int, layout: str = DEFAULT_LAYOUT) -> list[int]:
    """The cell (row * cols + col) of each object of ``render("textcaps", seed, index, layout=layout)``, in
    caption order. A caption names only its objects' quadrants; which of a quadrant's cells holds the object is
    the generator's draw, replayed here."""
    rng = np.random.default_rng([int(seed), _TASK_CODE["textcaps"], int(index)])
    return [cell for cell, _, _ in _textcaps_objects(rng, get_layout(layout))]


def scene_tint(task: str, seed: int, index: int, layout: str = DEFAULT_LAYOUT) -> float | None:
    """The canvas tint (0-1, uniform) of scene ``(task, seed, index)`` on a tinted layout, from a random stream of
    its own, so that a tinted scene's objects, texture and light are its untinted twin's; None where the layout is
    not tinted or the task draws no grid (video)."""
    if not get_layout(layout).tinted or check_task(task) == "video":
        return None
    return float(np.random.default_rng([int(seed), _TASK_CODE[task], int(index), _TINT_STREAM]).uniform())


def token_cells(lay: SceneLayout, grid_thw, patch: int = 28) -> np.ndarray:
    """(tokens,) the cell index (row * cols + col) of each merged visual token (raster order), from the cell of
    its top-left pixel; the layout's cells are whole tokens. ``grid_thw``: the processor's (t, h, w) in patches."""
    _, gh, gw = (int(x) for x in grid_thw)
    h, w = gh // 2, gw // 2
    if (h * patch, w * patch) != (lay.height, lay.width):
        raise ValueError(f"{h * patch}x{w * patch} px of tokens for a {lay.height}x{lay.width} layout")
    rows, cols = np.divmod(np.arange(h * w), w)
    return (rows * patch // lay.cell) * lay.cols + cols * patch // lay.cell


def render(task: str, seed: int, index: int, n_objects: int | None = None,
           layout: str = DEFAULT_LAYOUT, canvas_strength: float = 1.0) -> tuple[list[np.ndarray], str]:
    """Frames (uint8 HxWx3 arrays; one for images) and the ground-truth description.

    A pure function of its arguments: the same (task, seed, index, layout) always gives the same sample.
    ``n_objects`` forces a detailcaps scene's object count (default: drawn from the layout's range); the other
    tasks draw their own and refuse it. ``layout`` sets the scene grid of detailcaps and textcaps (video has its
    own). ``canvas_strength`` (0-1) fades a textured layout's canvas toward flat grey (training's ramp; data and
    evaluation keep 1).
    """
    check_task(task)
    lay = get_layout(layout)
    if not 0.0 <= canvas_strength <= 1.0:
        raise SyntheticError(f"canvas_strength must be in [0, 1], got {canvas_strength}")
    if canvas_strength != lay.canvas_strength:
        lay = replace(lay, canvas_strength=float(canvas_strength))
    if seed < 0 or index < 0:
        raise SyntheticError(f"seed and index must be >= 0, got seed={seed} index={index}")
    if n_objects is not None and task != "detailcaps":
        raise SyntheticError(f"n_objects sets a detailcaps scene's object count; {task} draws its own")
    rng = np.random.default_rng([int(seed), _TASK_CODE[task], int(index)])
    tint = scene_tint(task, seed, index, layout) or 0.0
    if task == "detailcaps":
        frames, text = _detailcaps(rng, n_objects, lay, tint)
    elif task == "textcaps":
        frames, text = _textcaps(rng, lay, tint)
    else:
        frames, text = _video(rng)
    return frames, canonical(text)


def encode_png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def scene_index(sample_id: str) -> int:
    """The scene index a ``make_record`` id ends in (``synthetic-...-s<seed>-<index>``)."""
    return int(sample_id.rsplit("-", 1)[1])


def make_record(task: str, seed: int, index: int, layout: str = DEFAULT_LAYOUT, n_objects: int | None = None) -> dict:
    """One row of the input schema. Scenes of a layout other than v1 carry its name in their id, so two
    layouts' samples never share a key in one output directory; a detailcaps scene with a forced object count
    (``n_objects``, see ``render``) carries the count, so it never shares one with the layout's own draw."""
    frames, text = render(task, seed, index, n_objects=n_objects, layout=layout)
    tag = "" if layout == "v1" or task == "video" else f"{layout}-"
    count = "" if n_objects is None else f"-n{n_objects}"
    return {
        "sample_id": f"synthetic-{tag}{task}{count}-s{seed}-{index:07d}",
        "task": task,
        "prompt": REGISTRY[task].prompt,
        "images": [encode_png(f) for f in frames],
        "references": [text],
        "source": SOURCE,
    }
