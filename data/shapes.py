"""A visual task generated offline, for vision-language models: `data.path: shapes`.

Each row is a picture of one to eight shapes (circles, squares, triangles in red, green, blue) drawn with PIL on a
white canvas, and asks how many there are: of all ("How many shapes are in the picture?"), of a colour ("How many red
shapes ...?") or of a kind ("How many circles ...?"), a third each; the answer is the count, exact. Shapes do not
overlap. Each row is drawn from its own seed (data/generated.py), so the same settings give the same pictures on every
machine and nothing is stored; the held-out split (`test`) draws from seeds the train split never uses.
`data.task_args`: `size` and `seed` of the train split, `test_size` and `test_seed` of the held-out one, and
`image_size` (the canvas's side in pixels).
"""

from __future__ import annotations

import io
import random

from grpo.data.generated import SPLIT_SETTINGS, row_seeds

PATH = "shapes"
DEFAULT_SIZE, DEFAULT_TEST_SIZE, DEFAULT_SEED, DEFAULT_IMAGE_SIZE = 1_000, 200, 0, 112
SETTINGS = (*SPLIT_SETTINGS, "image_size")
KINDS, COLOURS = ("circle", "square", "triangle"), {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220)}
MAX_SHAPES = 8


def is_shapes(path: str) -> bool:
    return path == PATH


def picture(seed: int, side: int) -> tuple[bytes, list[tuple[str, str]]]:
    """(a PNG of the seed's shapes, each shape's (colour, kind)); shapes sit in cells of a 3 x 3 grid (no overlap)."""
    from PIL import Image, ImageDraw

    r = random.Random(seed)
    count = r.randint(1, MAX_SHAPES)
    cells = r.sample(range(9), count)
    image = Image.new("RGB", (side, side), "white")
    draw, cell, shapes = ImageDraw.Draw(image), side // 3, []
    for at in cells:
        colour, kind = r.choice(list(COLOURS)), r.choice(KINDS)
        x, y, pad = (at % 3) * cell, (at // 3) * cell, max(2, cell // 6)
        box = (x + pad, y + pad, x + cell - pad, y + cell - pad)
        if kind == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif kind == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=COLOURS[colour])
        shapes.append((colour, kind))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), shapes


def shape_row(seed: int, side: int) -> dict:
    """One row: the picture and one question, a third each: how many shapes, how many of a colour, of a kind."""
    png, shapes = picture(seed, side)
    r = random.Random(seed ^ 0x5EED)
    asked = r.randrange(3)
    if asked == 0:
        question, count = "How many shapes are in the picture?", len(shapes)
    elif asked == 1:
        colour = r.choice(list(COLOURS))
        question, count = f"How many {colour} shapes are in the picture?", sum(c == colour for c, _ in shapes)
    else:
        kind = r.choice(KINDS)
        question, count = f"How many {kind}s are in the picture?", sum(k == kind for _, k in shapes)
    return {"question": question, "answer": str(count), "image": {"bytes": png}}


def shape_rows(split: str, task_args: dict) -> list[dict]:
    """The rows of a split (`train` or `test`); ValueError naming a setting it does not have."""
    seeds = row_seeds(PATH, SETTINGS, split, task_args, DEFAULT_SIZE, DEFAULT_TEST_SIZE, DEFAULT_SEED)
    side = int(task_args.get("image_size", DEFAULT_IMAGE_SIZE))
    return [shape_row(seed, side) for seed in seeds]
