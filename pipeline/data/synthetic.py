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
from dataclasses import dataclass, replace

import numpy as np

from pipeline.tasks import TASKS as REGISTRY

SOURCE = "synthetic"

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 90, 230),
    "yellow": (240, 215, 40),
    "purple": (150, 60, 200),
    "orange": (250, 140, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
SIZES = ("big", "small")
TEXTURES = ("plain", "striped", "dotted")
NUMBER_WORDS = ("one", "two", "three", "four", "five")
BACKGROUND = (128, 128, 128)  # plain grey canvas
# (A version that gave every grid cell its own shade of grey, as an absolute-position cue for the visual
# tokens, made the tiny model learn colours and shapes several times more slowly; plain it is.)



@dataclass(frozen=True)
class SceneLayout:
    """The grid of a detailcaps/textcaps scene. A merged Qwen2-VL visual token covers 28 x 28 px."""

    name: str
    rows: int
    cols: int
    cell: int  # px per cell side
    min_objects: int  # detailcaps objects per scene
    max_objects: int
    jitter: int  # an object's centre moves up to this many px from its cell's centre
    # the description walks every cell in raster order, empty ones included ("..., nothing ."), and relates an
    # object only to its right-hand neighbour: what a step needs to read is then in the cells it is describing
    every_cell: bool = False
    # the empty canvas is a smooth, faintly coloured random field with pixel grain instead of flat grey, as a
    # photo's background is: on flat grey every empty-canvas token carries the same value, and a tiny model parks
    # its idle attention on those hundreds of identical entries, a spread-out sink that no selection of 32 holds
    # (the attention probe, column `flat`); the objects keep their saturated colours
    textured: bool = False
    # how far a textured canvas departs from flat grey: 0 is its flat twin, 1 the full texture. Only training
    # sets it below 1 (the trainer's curriculum ramps it up, so that reading learnt on flat grey carries over)
    canvas_strength: float = 1.0
    # a textured canvas lit by position: brighter down the image and warmer to the right (``_light``), so that a
    # visual token's own pixels say where it is. Qwen2-VL's vision tower has no absolute position embedding and
    # its decoder sees an image token's place only through M-RoPE, relative to the query's own position; a
    # description step that names "row two , column three" then has no content to match, and the v4-trained
    # models spread their image attention over every cell alike
    lit: bool = False

    @property
    def height(self) -> int:
        return self.rows * self.cell

    @property
    def width(self) -> int:
        return self.cols * self.cell


LAYOUTS = {
    # 336 px, 4x4 cells of 84 px (3x3 tokens): 144 visual tokens, 8-10 objects (the shipped v1 model)
    "v1": SceneLayout("v1", rows=4, cols=4, cell=84, min_objects=8, max_objects=10, jitter=4),
    # 448 x 560 px, 5 rows x 4 columns of 112 px (4x4 tokens): 320 visual tokens, 11-14 objects of 1-4
    # tokens each, more object tokens than a 32-entry selection holds (the model being trained for v2)
    "v2": SceneLayout("v2", rows=5, cols=4, cell=112, min_objects=11, max_objects=14, jitter=12),
    # the v2 canvas with 12-18 of its 20 cells occupied (about 70 object tokens, twice the 32 selected), and
    # every cell described in raster order: which cells a step reads follows from where the description is
    "v3": SceneLayout("v3", rows=5, cols=4, cell=112, min_objects=12, max_objects=18, jitter=12, every_cell=True),
    # v3's scenes (the same objects for the same index) on a textured canvas
    "v4": SceneLayout("v4", rows=5, cols=4, cell=112, min_objects=12, max_objects=18, jitter=12, every_cell=True,
                      textured=True),
    # v4's scenes on a canvas lit by position (the same objects and texture draws for the same index)
    "v5": SceneLayout("v5", rows=5, cols=4, cell=112, min_objects=12, max_objects=18, jitter=12, every_cell=True,
                      textured=True, lit=True),
}
DEFAULT_LAYOUT = "v5"  # what the shipped model was trained on; flips with the model it belongs to
FRAME_SIZE = 168  # 12x12 patches -> 6x6 = 36 merged tokens per temporal patch
VIDEO_GRID = 3
VIDEO_CELL = FRAME_SIZE // VIDEO_GRID
VIDEO_POSITIONS = (
    "the top left", "the top", "the top right",
    "the left", "the centre", "the right",
    "the bottom left", "the bottom", "the bottom right",
)
QUADRANTS = ("the top left", "the top right", "the bottom left", "the bottom right")

# Object radii (px), where a merged visual token covers 28x28 px. Objects this small
# fit in 1-4 tokens, so each token the decoder attends to shows the object's outline: with radii 34/21
# (2-3 tokens across) the tiny model learned colour, texture and size but never shape.
BIG_RADIUS = 22.0
SMALL_RADIUS = 13.0

HELDOUT_SEED = 10_000  # evaluation and the embedded job's shards use this seed: training refuses it (its recipe)

# the tasks this generator draws, in the order that sets each one's seed offset (never reorder)
TASKS = ("detailcaps", "textcaps", "video")
_TASK_CODE = {t: i + 1 for i, t in enumerate(TASKS)}


class SyntheticError(ValueError):
    """Bad arguments to the synthetic generator (unknown task, bad count ...)."""


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


# ----------------------------------------------------------------------------------------- rendering
def _shape_mask(shape: str, radius: float, size: int) -> np.ndarray:
    """Boolean mask of a shape centred in a ``size`` x ``size`` box."""
    c = (size - 1) / 2.0
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    dx, dy = xx - c, yy - c
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius
    if shape == "square":
        r = radius * 0.85
        return (np.abs(dx) <= r) & (np.abs(dy) <= r)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= radius * 1.1
    if shape == "triangle":  # upward, apex at top
        top, bottom = -radius, radius * 0.8
        frac = (dy - top) / (bottom - top)
        return (dy >= top) & (dy <= bottom) & (np.abs(dx) <= frac * radius)
    raise SyntheticError(f"unknown shape {shape!r}")


def _texture_mask(texture: str, size: int, phase: int) -> np.ndarray:
    """True where the object's own colour shows; False where the dark pattern shows."""
    yy, xx = np.mgrid[0:size, 0:size]
    if texture == "plain":
        return np.ones((size, size), dtype=bool)
    if texture == "striped":  # horizontal stripes, period 8 px
        return ((yy + phase) // 4) % 2 == 0
    if texture == "dotted":  # dots of radius ~2 px on an 8 px lattice
        ddx = (xx + phase) % 8 - 3.5
        ddy = (yy + phase) % 8 - 3.5
        return ddx * ddx + ddy * ddy > 5.0
    raise SyntheticError(f"unknown texture {texture!r}")


def _paint(img: np.ndarray, cx: int, cy: int, obj: SceneObject, radius: float, phase: int = 0) -> None:
    box = int(2 * radius + 4) | 1
    half = box // 2
    mask = _shape_mask(obj.shape, radius, box)
    tex = _texture_mask(obj.texture, box, phase)
    colour = np.array(COLOURS[obj.colour], dtype=np.uint8)
    dark = (colour.astype(np.float32) * 0.3).astype(np.uint8)
    patch = np.where(tex[..., None], colour, dark)
    y0, x0 = cy - half, cx - half
    # clip to the canvas
    ys, xs = max(0, -y0), max(0, -x0)
    ye, xe = min(box, img.shape[0] - y0), min(box, img.shape[1] - x0)
    region = img[y0 + ys:y0 + ye, x0 + xs:x0 + xe]
    m = mask[ys:ye, xs:xe]
    region[m] = patch[ys:ye, xs:xe][m]


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str = "big"
    texture: str = "plain"

    def phrase(self) -> str:
        return f"{self.size} {self.colour} {self.texture} {self.shape}"

    def short(self) -> str:
        return f"{self.colour} {self.shape}"


def _random_object(rng: np.random.Generator) -> SceneObject:
    return SceneObject(
        shape=SHAPES[rng.integers(len(SHAPES))],
        colour=list(COLOURS)[rng.integers(len(COLOURS))],
        size=SIZES[rng.integers(len(SIZES))],
        texture=TEXTURES[rng.integers(len(TEXTURES))],
    )


def _blank(height: int, width: int | None = None) -> np.ndarray:
    img = np.empty((height, height if width is None else width, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    return img


def _render_grid(rng: np.random.Generator, cells: dict[int, SceneObject], lay: SceneLayout) -> np.ndarray:
    img = _blank(lay.height, lay.width)
    for cell, obj in cells.items():
        r, c = divmod(cell, lay.cols)
        jx, jy = rng.integers(-lay.jitter, lay.jitter + 1, size=2)
        cx = c * lay.cell + lay.cell // 2 + int(jx)
        cy = r * lay.cell + lay.cell // 2 + int(jy)
        radius = BIG_RADIUS if obj.size == "big" else SMALL_RADIUS
        _paint(img, cx, cy, obj, radius, phase=int(rng.integers(8)))
    if lay.textured:  # drawn after the objects, so a v4 scene's objects are its v3 twin's
        empty = (img == np.array(BACKGROUND, dtype=np.uint8)).all(-1)
        img[empty] = _canvas(rng, img.shape[0], img.shape[1], lay.canvas_strength, lit=lay.lit)[empty]
    return img


def _light(height: int, width: int) -> np.ndarray:
    """(H, W, 3) float: a lit canvas's departure from grey by position alone: brightness from -50 at the top row
    to +50 at the bottom, and warmth (red up, blue down) from -30 at the left edge to +30 at the right. Adjacent
    cells of v5 (112 px) differ by 20 in brightness or 30 in red - blue, more than the halved texture's +-20."""
    y = (np.arange(height) + 0.5) / height - 0.5  # (H,) in (-0.5, 0.5)
    x = (np.arange(width) + 0.5) / width - 0.5  # (W,)
    bright = 100.0 * y[:, None] + np.zeros((1, width))
    warm = 60.0 * x[None, :] + np.zeros((height, 1))
    return np.stack([bright + warm, bright, bright - warm], axis=-1)


def _canvas(rng: np.random.Generator, height: int, width: int, strength: float = 1.0, lit: bool = False,
            step: int = 40) -> np.ndarray:
    """(H, W, 3) uint8: per channel, grey 128 +- 40 on a coarse grid every ``step`` px, interpolated bilinearly
    (low saturation: the channels drift apart by at most 80 of 255 before the grain), plus +-10 grain per pixel;
    ``lit``: the coarse field halved and ``_light`` added. The departure from grey is scaled by ``strength``.
    The random draws depend on neither ``strength`` nor ``lit``."""
    gh, gw = height // step + 2, width // step + 2
    coarse = rng.uniform(88.0, 168.0, size=(gh, gw, 3))
    y = np.arange(height) / step
    x = np.arange(width) / step
    y0, x0 = y.astype(int), x.astype(int)
    fy, fx = (y - y0)[:, None, None], (x - x0)[None, :, None]
    top = coarse[y0][:, x0] * (1 - fx) + coarse[y0][:, x0 + 1] * fx
    bottom = coarse[y0 + 1][:, x0] * (1 - fx) + coarse[y0 + 1][:, x0 + 1] * fx
    smooth = top * (1 - fy) + bottom * fy
    if lit:
        smooth = 128.0 + 0.5 * (smooth - 128.0) + _light(height, width)
    field = smooth + rng.uniform(-10.0, 10.0, size=(height, width, 3))
    field = 128.0 + strength * (field - 128.0)
    return np.clip(np.rint(field), 0, 255).astype(np.uint8)


# ----------------------------------------------------------------------------------------- tasks
def _detailcaps(rng: np.random.Generator, n_objects: int | None, lay: SceneLayout) -> tuple[list[np.ndarray], str]:
    n = int(rng.integers(lay.min_objects, lay.max_objects + 1)) if n_objects is None else n_objects
    n_cells = lay.rows * lay.cols
    if not 1 <= n <= n_cells:
        raise SyntheticError(f"n_objects must be in 1..{n_cells}, got {n}")
    chosen = sorted(rng.choice(n_cells, size=n, replace=False).tolist())
    cells = {cell: _random_object(rng) for cell in chosen}
    img = _render_grid(rng, cells, lay)
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
        placed.append((r * lay.cols + c, _random_object(rng), q))
    return placed


def _textcaps(rng: np.random.Generator, lay: SceneLayout) -> tuple[list[np.ndarray], str]:
    placed = _textcaps_objects(rng, lay)
    img = _render_grid(rng, {cell: obj for cell, obj, _ in placed}, lay)
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
            img = _blank(FRAME_SIZE)
            for j, obj in enumerate(objs):
                p = centre(paths[j][k])
                if sub >= 2 and k + 1 < n_way:
                    p = (p + centre(paths[j][k + 1])) / 2
                _paint(img, int(p[0]), int(p[1]), obj, 18.0)
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


def token_cells(lay: SceneLayout, grid_thw, patch: int = 28) -> np.ndarray:
    """(tokens,) the cell index (row * cols + col) of each merged visual token (raster order), from the cell of
    its top-left pixel; the layout's cells are whole tokens. ``grid_thw``: the processor's (t, h, w) in patches."""
    _, gh, gw = (int(x) for x in grid_thw)
    h, w = gh // 2, gw // 2
    if (h * patch, w * patch) != (lay.height, lay.width):
        raise ValueError(f"{h * patch}x{w * patch} px of tokens for a {lay.height}x{lay.width} layout")
    rows, cols = np.divmod(np.arange(h * w), w)
    return (rows * patch // lay.cell) * lay.cols + cols * patch // lay.cell


def get_layout(name: str) -> SceneLayout:
    if name not in LAYOUTS:
        raise SyntheticError(f"unknown scene layout {name!r}: field 'layout' must be one of {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


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
    if task == "detailcaps":
        frames, text = _detailcaps(rng, n_objects, lay)
    elif task == "textcaps":
        frames, text = _textcaps(rng, lay)
    else:
        frames, text = _video(rng)
    return frames, canonical(text)


def encode_png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


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
