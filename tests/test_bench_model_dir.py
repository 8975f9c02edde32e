"""The preset directory an external engine starts on offline (rollplex/bench/model_dir.py): the released
checkpoints' config layout, and a tokenizer whose special tokens sit at the config's ids."""

import json

import pytest
from transformers import AutoTokenizer

from rollplex.bench.model_dir import write_model_dir
from rollplex.models import ModelConfig
from rollplex.presets import preset


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


def test_only_qwen25_vl_configs(tmp_path):
    with pytest.raises(ValueError, match="Qwen2.5-VL"):
        write_model_dir(preset("qwen3-vl-2b"), tmp_path)
