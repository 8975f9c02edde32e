"""What the model takes per sequence: token ids plus the images and videos they refer to.

`ModelInputs` is the one prompt type of the runtime: the processor returns it, the engine queues
it, the RL batch holds it and the model embeds it. Pixel tensors are in the layout of transformers'
Qwen2-VL processors (rows = patches in (t, h/merge, w/merge, merge, merge) order); every
`<|image_pad|>` / `<|video_pad|>` id of `input_ids` before `text_after` takes one merged patch.

`text_after` marks where generated tokens start (a prompt continued by a response, or a sequence
re-prefilled after preemption): tokens from there on are text even if a model emitted a placeholder
id, exactly as the response path embeds them.

`vision_embeds` optionally carries the prompt's merged visual features (its images, then its videos,
[placeholders, C]) computed earlier — the engine's prefill encodings reused by the reference and a
frozen-vision actor — so the model skips its vision tower for this prompt. Only valid while the vision
tower that made them is the one that would run (a frozen tower).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

Grid = tuple[int, int, int]  # (t, h, w) in patches


def grid_list(g: torch.Tensor | Sequence[Sequence[int]] | None) -> list[Grid]:
    """[n, 3] grids (a tensor or nested lists) -> a list of (t, h, w) int tuples."""
    if g is None:
        return []
    if isinstance(g, torch.Tensor):
        g = g.tolist()
    return [tuple(int(x) for x in row) for row in g]


@dataclass
class ModelInputs:
    input_ids: list[int]
    pixel_values: torch.Tensor | None = None  # float [num_patches, C * T * P * P]
    image_grid_thw: torch.Tensor | None = None  # long [num_images, 3]
    pixel_values_videos: torch.Tensor | None = None  # float [num_patches, C * T * P * P]
    video_grid_thw: torch.Tensor | None = None  # long [num_videos, 3]
    second_per_grid_ts: list[float] | None = None  # per video: seconds per temporal grid step
    text_after: int | None = None  # tokens from this index on were generated (plain text); None: none
    vision_embeds: torch.Tensor | None = None  # [placeholders, C] merged visual features, images then videos

    def __post_init__(self):
        if self.text_after is not None and not 0 <= self.text_after <= len(self.input_ids):
            raise ValueError(f"text_after={self.text_after} is outside the {len(self.input_ids)} input ids")

    @property
    def has_vision(self) -> bool:
        return bool(self.image_grids) or bool(self.video_grids)

    @property
    def image_grids(self) -> list[Grid]:
        return grid_list(self.image_grid_thw)

    @property
    def video_grids(self) -> list[Grid]:
        return grid_list(self.video_grid_thw)

    @property
    def prompt_len(self) -> int:
        """Tokens before the generated ones: the part whose placeholders take visual embeddings."""
        return self.text_after or len(self.input_ids)

    def with_response(self, response: Sequence[int]) -> ModelInputs:
        """All of this sequence's tokens as the prompt, followed by generated ones (same images and videos)."""
        return replace(self, input_ids=[*self.input_ids, *response], text_after=len(self.input_ids))
