"""Config parsing, weight loading (single file and sharded), the tokenizer, and every loading error."""

from __future__ import annotations

import json
import shutil

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file

from cadence.gpu import (
    CheckpointError,
    CheckpointFileNotFoundError,
    MissingWeightError,
    ModelConfig,
    RopeScaling,
    Tokenizer,
    UnexpectedWeightError,
    UnsupportedArchitectureError,
    WeightShapeError,
    get_attention_backend,
    preset,
)
from cadence.gpu.loader import checkpoint_files, load_weights
from cadence.gpu.model import build_model
from cadence.statemachine.errors import CadenceError, ConfigError

# config.json of Qwen/Qwen3-0.6B as published.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def copy_checkpoint(hf_checkpoint, tmp_path, kind="llama"):
    source, _ = hf_checkpoint(kind)
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def load_into_fresh_model(directory):
    config = ModelConfig.from_pretrained(directory)
    model = build_model(config, get_attention_backend("reference"), torch.float32, "cpu")
    load_weights(model, directory)
    return model


def test_qwen3_preset_matches_the_published_config():
    parsed = ModelConfig.from_hf_config(QWEN3_0_6B)
    assert parsed.qk_norm and parsed.tie_word_embeddings and parsed.rope_scaling is None
    assert attrs.evolve(parsed, eos_token_ids=preset("qwen3-0.6b").eos_token_ids) == preset("qwen3-0.6b")


def test_qwen3_preset_parameters_line_up_with_transformers():
    import transformers

    # Two layers instead of 28: the names and shapes repeat per layer.
    fields = {k: v for k, v in QWEN3_0_6B.items() if k != "architectures"}
    hf_config = transformers.Qwen3Config(**{**fields, "num_hidden_layers": 2})
    with torch.device("meta"):
        hf_model = transformers.Qwen3ForCausalLM(hf_config)
    expected = {n: tuple(p.shape) for n, p in hf_model.named_parameters() if n != "lm_head.weight"}
    config = attrs.evolve(preset("qwen3-0.6b"), num_layers=2)
    model = build_model(config, get_attention_backend("reference"), torch.bfloat16, "meta")
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == expected


def test_old_style_rope_fields_are_read():
    hf = {**QWEN3_0_6B, "model_type": "llama", "rope_theta": 500000.0,
          "rope_scaling": {"type": "linear", "factor": 4.0}}
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(rope_type="linear", factor=4.0)
    assert not config.qk_norm and not config.qkv_bias


def test_mistral_sliding_window_caps_max_model_len():
    config = ModelConfig.from_hf_config({**QWEN3_0_6B, "model_type": "mistral", "sliding_window": 4096})
    assert config.max_model_len == 4096


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "architecture 'gpt2' is not supported"),
        ({"model_type": None, "architectures": ["FalconForCausalLM"]}, "'FalconForCausalLM' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_configs_are_named(change, match):
    with pytest.raises(UnsupportedArchitectureError, match=match):
        ModelConfig.from_hf_config({**QWEN3_0_6B, **change})


def test_bad_config_fields_are_named():
    broken = dict(QWEN3_0_6B)
    del broken["hidden_size"]
    with pytest.raises(CheckpointError, match="'hidden_size' is missing"):
        ModelConfig.from_hf_config(broken)
    with pytest.raises(CheckpointError, match="num_heads .16. must be a multiple of num_kv_heads .5."):
        ModelConfig.from_hf_config({**QWEN3_0_6B, "num_key_value_heads": 5})
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        preset("huge")


def test_generation_config_eos_ids_are_merged(hf_checkpoint, tmp_path):
    directory = copy_checkpoint(hf_checkpoint, tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert ModelConfig.from_pretrained(directory).eos_token_ids == (2, 9)


def test_sharded_checkpoint_loads_the_same_weights(hf_checkpoint, tmp_path):
    source, hf_model = hf_checkpoint("qwen2")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(checkpoint_files(tmp_path)) > 1
    sharded, single = load_into_fresh_model(tmp_path), load_into_fresh_model(source)
    for (name, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_missing_files_are_named(hf_checkpoint, tmp_path):
    with pytest.raises(CheckpointFileNotFoundError, match="config.json does not exist"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointFileNotFoundError, match="does not exist"):
        checkpoint_files(tmp_path / "nowhere")
    directory = copy_checkpoint(hf_checkpoint, tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointFileNotFoundError, match=r"no \*.safetensors weights"):
        load_into_fresh_model(directory)


def test_missing_shard_is_named(hf_checkpoint, tmp_path):
    _, hf_model = hf_checkpoint("qwen2")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointFileNotFoundError, match=f"shard {shard.name} listed in"):
        load_into_fresh_model(tmp_path)


def rewrite_weights(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_shape_mismatch_names_the_tensor(hf_checkpoint, tmp_path):
    directory = copy_checkpoint(hf_checkpoint, tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite_weights(directory, lambda t: t.update({name: torch.zeros(16, 64)}))
    with pytest.raises(WeightShapeError, match=rf"'{name}' has shape \(16, 64\), the model expects \(32, 64\)"):
        load_into_fresh_model(directory)


def test_missing_and_unexpected_tensors_are_named(hf_checkpoint, tmp_path):
    directory = copy_checkpoint(hf_checkpoint, tmp_path)
    rewrite_weights(directory, lambda t: t.pop("model.layers.0.mlp.up_proj.bias"))
    with pytest.raises(MissingWeightError, match="lacks 1 tensors: model.layers.0.mlp.up_proj.bias"):
        load_into_fresh_model(directory)
    rewrite_weights(directory, lambda t: t.update({"model.layers.0.mlp.up_proj.bias": torch.zeros(128),
                                                   "model.vision_tower.weight": torch.zeros(2)}))
    with pytest.raises(UnexpectedWeightError, match="'model.vision_tower.weight'"):
        load_into_fresh_model(directory)


def test_corrupt_files_raise_checkpoint_errors(hf_checkpoint, tmp_path):
    directory = copy_checkpoint(hf_checkpoint, tmp_path)
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_into_fresh_model(directory)
    (directory / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        ModelConfig.from_pretrained(directory)
    assert issubclass(CheckpointError, CadenceError) and issubclass(CheckpointError, ValueError)


def write_tokenizer(directory):
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "again": 5}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [5], "bos_token_id": 1}))


def test_tokenizer_round_trip_and_eos_ids(tmp_path):
    write_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode("hello world again")
    assert ids == [3, 4, 5]
    assert tokenizer.decode(ids + [2]) == "hello world again"
    assert tokenizer.decode([1, 3], skip_special_tokens=False) == "<s> hello"
    assert tokenizer.eos_token_ids == (5, 2) and tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == 6 and tokenizer.token_to_id("world") == 4


def test_tokenizer_missing_or_corrupt_file_is_named(tmp_path):
    with pytest.raises(CheckpointFileNotFoundError, match="tokenizer.json does not exist"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json could not be loaded"):
        Tokenizer.from_pretrained(tmp_path)
