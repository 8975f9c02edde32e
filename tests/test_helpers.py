"""The tests' own random inputs: random prompt text never holds a vision special id, and a sampled
response that does is scored as text (how the engine tests rebuild prompt + response)."""

import pytest
import torch
from helpers import IMG, VE, VID, VS, kernel_model, make_prompt, random_text_ids

from rollplex.models import ModelConfig


def test_random_text_ids_stay_below_the_vision_specials():
    model = kernel_model("cpu")
    cfg = model.cfg
    ids = random_text_ids(20000, torch.Generator().manual_seed(0), cfg=cfg)
    specials = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id}
    assert ids.min() >= 3 and ids.max() < min(specials) and ids.max() >= min(specials) - 2  # the whole range
    assert random_text_ids((4, 5), None, vocab=50).shape == (4, 5)
    # specials anywhere in the vocabulary: the range ends below the lowest, whatever the vocabulary size
    low = ModelConfig(text=cfg.text, vision=cfg.vision, image_token_id=40, video_token_id=VID,
                      vision_start_token_id=VS, vision_end_token_id=VE)
    assert random_text_ids(5000, torch.Generator().manual_seed(1), cfg=low).max() < 40
    with pytest.raises(ValueError, match="plain-text"):
        random_text_ids(3, vocab=3)
    # a random prompt's vision tokens are exactly its images' placeholders
    p = make_prompt(torch.Generator().manual_seed(2), images=[(1, 4, 6)], text_len=(300, 300), vocab=10**6)
    assert p.input_ids.count(IMG) == 6 and VID not in p.input_ids and p.input_ids.count(VS) == 1


def test_sampled_placeholders_in_a_response_are_text():
    model = kernel_model("cpu")
    p = make_prompt(torch.Generator().manual_seed(0), images=[(1, 4, 6)], text_len=(3, 5))
    with torch.no_grad():
        logits = model([p.with_response([5, VID, IMG, VS, 7])])[0]
        with pytest.raises(ValueError, match="more video tokens"):  # read as a prompt, they are placeholders
            model([type(p)(p.input_ids + [5, VID, 7], p.pixel_values, p.image_grid_thw)])
    assert logits.shape == (len(p.input_ids) + 5, model.cfg.text.vocab_size) and torch.isfinite(logits).all()
