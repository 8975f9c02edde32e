"""The preset directory an external engine starts on offline (rollplex/bench/model_dir.py): the released
checkpoints' config layout, and a tokenizer whose special tokens sit at the config's ids."""

import json

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

from rollplex.bench.model_dir import write_model_dir
from rollplex.models import ModelConfig, Qwen3VLConfig
from rollplex.presets import preset
from rollplex.processor import VLProcessor


def test_preset_dir_has_the_config_and_qwen_special_ids(tmp_path):
    cfg = preset("qwen2.5-vl-3b")
    out = write_model_dir(cfg, tmp_path / "m")
    assert ModelConfig.from_hf(json.loads((out / "config.json").read_text())) == cfg
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id == 151655
    assert tok.convert_tokens_to_ids("<|vision_start|>") == cfg.vision_start_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") == cfg.eos_token_id
    ids = tok("a red circle").input_ids
    assert max(ids) < 1000 and tok.decode(ids) == "a red circle"  # the BPE part, fillers never emitted
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (14, 2, 2)


def test_qwen3_vl_dir_is_the_released_layout(tmp_path):
    cfg = preset("qwen3-vl-4b")
    out = write_model_dir(cfg, tmp_path / "m")
    raw = json.loads((out / "config.json").read_text())
    assert set(raw) >= {"text_config", "vision_config"} and "hidden_size" not in raw  # nested, as released
    assert raw["text_config"]["rope_scaling"] == {"rope_type": "default", "mrope_section": [24, 20, 20],
                                                  "mrope_interleaved": True}
    hf = AutoConfig.from_pretrained(out)  # transformers' own reading of it
    assert type(hf).__name__ == "Qwen3VLConfig" and hf.architectures == ["Qwen3VLForConditionalGeneration"]
    t, v = hf.text_config, hf.vision_config
    rope = dict(getattr(t, "rope_parameters", None) or t.rope_scaling)
    assert rope["mrope_interleaved"] is True and list(rope["mrope_section"]) == [24, 20, 20]
    assert (t.hidden_size, t.num_hidden_layers, t.num_key_value_heads, t.head_dim) == (2560, 36, 8, 128)
    assert (v.patch_size, v.depth, list(v.deepstack_visual_indexes), v.out_hidden_size) == (16, 24, [5, 11, 17], 2560)
    assert hf.tie_word_embeddings is True and hf.image_token_id == 151655
    assert Qwen3VLConfig.from_hf(str(out)) == cfg
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (16, 2, 2)
    assert pre["processor_class"] == "Qwen3VLProcessor" and pre["image_mean"] == [0.5, 0.5, 0.5]
    # (AutoProcessor would build Qwen3VLVideoProcessor too, which needs torchvision)
    image_processor = AutoImageProcessor.from_pretrained(out)
    assert image_processor.patch_size == 16
    ours = VLProcessor.from_pretrained(out)  # the trainer's processor reads the same files
    assert ours.video_timestamps  # Qwen3-VL's video layout, from config.json's model_type
    img = Image.new("RGB", (64, 96), (200, 30, 30))
    got = image_processor(images=[img], return_tensors="pt")
    mine = ours.encode(text="<|vision_start|><|image_pad|><|vision_end|>", images=[img])
    assert mine.image_grid_thw.tolist() == got["image_grid_thw"].tolist()
    assert mine.pixel_values.shape[1] == 3 * 2 * 16 * 16
    assert torch.allclose(mine.pixel_values, got["pixel_values"].float(), atol=1e-5)


def test_only_qwen_vl_configs(tmp_path):
    with pytest.raises(ValueError, match="Qwen2.5-VL or Qwen3-VL"):
        write_model_dir(preset("qwen2.5-vl-3b").text, tmp_path)
