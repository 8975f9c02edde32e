"""The embedded demo task: "What colour is the shape?" — answerable only from the image.

Each row is a 56x56 image of one shape (circle, square or triangle; random size and place) in one
of four colours, and a multiple-choice question with the options in a fixed order; the ground truth
is the option letter. Rows follow verl's format (`data_source = "rollplex/shape_color"`) and the
reward is `rollplex.rl.rewards.shape_color` (1 for the right letter, else 0). A policy that answers
with a letter but cannot see scores 0.25: that is chance. `demo_image` draws one fixed circle, for
examples and tests that need an image.
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 30)}
LETTERS = "ABCD"
DATA_SOURCE = "rollplex/shape_color"
CHANCE = 1 / len(COLORS)  # the reward of a policy that answers with a letter but cannot see
QUESTION = ("<image>What color is the shape?\n"
            + "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(COLORS))
            + "\nAnswer with the letter only.")


def demo_image(color: str = "red", size: int = 56) -> Image.Image:
    """A centred circle of a PIL colour name on white."""
    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).ellipse([8, 8, size - 8, size - 8], fill=color)
    return img


def draw_shape(color: str, rng: random.Random, size: int = 56) -> Image.Image:
    img = Image.new("RGB", (size, size), (255, 255, 255))
    d = ImageDraw.Draw(img)
    s = rng.randint(size // 2, size - 6)
    x, y = rng.randint(0, size - s), rng.randint(0, size - s)
    kind = rng.choice(["circle", "square", "triangle"])
    fill = COLORS[color]
    if kind == "circle":
        d.ellipse([x, y, x + s, y + s], fill=fill)
    elif kind == "square":
        d.rectangle([x, y, x + s, y + s], fill=fill)
    else:
        d.polygon([(x + s / 2, y), (x, y + s), (x + s, y + s)], fill=fill)
    return img


def make_rows(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(n):
        color = rng.choice(list(COLORS))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": QUESTION}],
            "images": [draw_shape(color, rng)],
            "ability": "visual_recognition",
            "reward_model": {"style": "rule", "ground_truth": LETTERS[list(COLORS).index(color)]},
            "extra_info": {"split": split, "index": i, "color": color},
        })
    return rows
