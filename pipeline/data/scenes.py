"""The synthetic scenes' drawing: colours, shapes, sizes and textures of an object, the scene layouts (grids of
cells), and the painting of objects on a canvas (flat, textured, lit). Plain numpy, no anti-aliasing: a scene is
bit-identical across machines. The tasks' samples and descriptions are ``pipeline/data/synthetic.py``'s."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
BACKGROUND = (128, 128, 128)  # plain grey canvas
# (A version that gave every grid cell its own shade of grey, as an absolute-position cue for the visual
# tokens, made the tiny model learn colours and shapes several times more slowly; plain it is.)


class SyntheticError(ValueError):
    """Bad arguments to the synthetic generator (unknown task, bad count ...)."""


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
    # a textured canvas lit by position: brighter down the image and warmer to the right (``light``), so that a
    # visual token's own pixels say where it is. Qwen2-VL's vision tower has no absolute position embedding and
    # its decoder sees an image token's place only through M-RoPE, relative to the query's own position; a
    # description step that names "row two , column three" then has no content to match, and the v4-trained
    # models spread their image attention over every cell alike
    lit: bool = False
    # a canvas tinted per scene (``scene_tint``, a draw of its own): the empty canvas shifts by ``tint *
    # TINT_SHIFT``, along the one colour axis that neither the light (brightness, warmth) nor anything else of the
    # scene moves, so that the image shows a per-sample property the objects and their cells do not depend on.
    # The drift test bed's share stage sets each sample's image share of attention from it (docs/embedded.md)
    tinted: bool = False

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
    # v5's scenes (the same objects, texture and light for the same index) with a canvas tint drawn per scene
    "v6": SceneLayout("v6", rows=5, cols=4, cell=112, min_objects=12, max_objects=18, jitter=12, every_cell=True,
                      textured=True, lit=True, tinted=True),
}
DEFAULT_LAYOUT = "v5"  # what the shipped model was trained on; flips with the model it belongs to

# Object radii (px), where a merged visual token covers 28x28 px. Objects this small
# fit in 1-4 tokens, so each token the decoder attends to shows the object's outline: with radii 34/21
# (2-3 tokens across) the tiny model learned colour, texture and size but never shape.
BIG_RADIUS = 22.0
SMALL_RADIUS = 13.0


def get_layout(name: str) -> SceneLayout:
    if name not in LAYOUTS:
        raise SyntheticError(f"unknown scene layout {name!r}: field 'layout' must be one of {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def shape_mask(shape: str, radius: float, size: int) -> np.ndarray:
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


def texture_mask(texture: str, size: int, phase: int) -> np.ndarray:
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


def paint(img: np.ndarray, cx: int, cy: int, obj: SceneObject, radius: float, phase: int = 0) -> None:
    box = int(2 * radius + 4) | 1
    half = box // 2
    mask = shape_mask(obj.shape, radius, box)
    tex = texture_mask(obj.texture, box, phase)
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


def random_object(rng: np.random.Generator) -> SceneObject:
    return SceneObject(
        shape=SHAPES[rng.integers(len(SHAPES))],
        colour=list(COLOURS)[rng.integers(len(COLOURS))],
        size=SIZES[rng.integers(len(SIZES))],
        texture=TEXTURES[rng.integers(len(TEXTURES))],
    )


def blank(height: int, width: int | None = None) -> np.ndarray:
    img = np.empty((height, height if width is None else width, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    return img


# green up, red and blue down: orthogonal to the light's brightness (1, 1, 1) and warmth (1, 0, -1) axes, so a tint
# never reads as a position; at tint 1 the canvas's green - (red + blue) / 2 moves by 60, against a spread of about
# 14 from the halved texture
TINT_SHIFT = (-20.0, 40.0, -20.0)


def render_grid(rng: np.random.Generator, cells: dict[int, SceneObject], lay: SceneLayout,
                tint: float = 0.0) -> np.ndarray:
    """The scene's image; ``tint`` (0-1, a tinted layout's ``scene_tint``) shifts its empty canvas."""
    img = blank(lay.height, lay.width)
    for cell, obj in cells.items():
        r, c = divmod(cell, lay.cols)
        jx, jy = rng.integers(-lay.jitter, lay.jitter + 1, size=2)
        cx = c * lay.cell + lay.cell // 2 + int(jx)
        cy = r * lay.cell + lay.cell // 2 + int(jy)
        radius = BIG_RADIUS if obj.size == "big" else SMALL_RADIUS
        paint(img, cx, cy, obj, radius, phase=int(rng.integers(8)))
    if lay.textured:  # drawn after the objects, so a v4 scene's objects are its v3 twin's
        empty = (img == np.array(BACKGROUND, dtype=np.uint8)).all(-1)
        img[empty] = canvas(rng, img.shape[0], img.shape[1], lay.canvas_strength, lit=lay.lit)[empty]
        if tint:  # part of the canvas: it fades with it
            shift = tint * lay.canvas_strength * np.asarray(TINT_SHIFT, dtype=np.float32)
            shifted = img[empty].astype(np.float32) + shift
            img[empty] = np.clip(np.rint(shifted), 0, 255).astype(np.uint8)
    return img


def light(height: int, width: int) -> np.ndarray:
    """(H, W, 3) float: a lit canvas's departure from grey by position alone: brightness from -50 at the top row
    to +50 at the bottom, and warmth (red up, blue down) from -30 at the left edge to +30 at the right. Adjacent
    cells of v5 (112 px) differ by 20 in brightness or 30 in red - blue, more than the halved texture's +-20."""
    y = (np.arange(height) + 0.5) / height - 0.5  # (H,) in (-0.5, 0.5)
    x = (np.arange(width) + 0.5) / width - 0.5  # (W,)
    bright = 100.0 * y[:, None] + np.zeros((1, width))
    warm = 60.0 * x[None, :] + np.zeros((height, 1))
    return np.stack([bright + warm, bright, bright - warm], axis=-1)


def canvas(rng: np.random.Generator, height: int, width: int, strength: float = 1.0, lit: bool = False,
            step: int = 40) -> np.ndarray:
    """(H, W, 3) uint8: per channel, grey 128 +- 40 on a coarse grid every ``step`` px, interpolated bilinearly
    (low saturation: the channels drift apart by at most 80 of 255 before the grain), plus +-10 grain per pixel;
    ``lit``: the coarse field halved and ``light`` added. The departure from grey is scaled by ``strength``.
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
        smooth = 128.0 + 0.5 * (smooth - 128.0) + light(height, width)
    field = smooth + rng.uniform(-10.0, 10.0, size=(height, width, 3))
    field = 128.0 + strength * (field - 128.0)
    return np.clip(np.rint(field), 0, 255).astype(np.uint8)
