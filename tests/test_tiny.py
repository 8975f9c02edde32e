"""The embedded tiny checkpoint: written by `python -m rollplex.tiny`, read by us and by transformers;
reference generation equals transformers' greedy `generate` with an image in the prompt."""

import subprocess
import sys

import pytest
import torch
from PIL import Image

from rollplex.generate import generate
from rollplex.models import load_model
from rollplex.processor import VLProcessor
from rollplex.tiny.shape_color import demo_image


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, "-m", "rollplex.tiny", str(out), "--seed", "3"], check=True)
    return out


def test_tiny_checkpoint_loads_everywhere(tiny_dir):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    ours = load_model(tiny_dir)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    proc = VLProcessor.from_pretrained(tiny_dir)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == ours.cfg.image_token_id == proc.image_token_id
    assert proc.eos_token_id == ours.cfg.eos_token_id


def test_generate_matches_transformers_greedy(tiny_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    ours = load_model(tiny_dir).eval()
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir, attn_implementation="eager").eval()
    proc = VLProcessor.from_pretrained(tiny_dir)
    images = [demo_image("blue"), Image.new("RGB", (45, 70), "green")]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                         {"type": "text", "text": "Which is blue?"}]}]
    p = proc.encode(messages=msgs, images=images)
    gen = generate(ours, p, max_new_tokens=12)
    ids = torch.tensor([p.input_ids])
    mm = (ids == proc.image_token_id).int()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=p.pixel_values,
                          image_grid_thw=p.image_grid_thw, mm_token_type_ids=mm, max_new_tokens=12,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    assert gen.token_ids == out[0, ids.shape[1]:].tolist()
