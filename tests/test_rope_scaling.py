"""model.rope_scaling reaches the model: its config, max_position_embeddings and the rotary embedding it builds,
and the context check then takes the scaled length."""

from __future__ import annotations

import pytest
import torch
from helpers import run_train, write_recipe

from llmtrain.config import load_recipe
from llmtrain.model.modeling import load_model


def rotary(tiny_assets, tmp_path, **model):
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, model=model))
    m = load_model(recipe.model, None)
    return m.config, m.model.rotary_emb


def test_linear_scaling_divides_the_frequencies_and_extends_the_positions(tiny_assets, tmp_path):
    base_config, base = rotary(tiny_assets, tmp_path)
    config, scaled = rotary(tiny_assets, tmp_path, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 4.0
    assert config.rope_parameters["rope_theta"] == base_config.rope_parameters["rope_theta"]  # the model's own kept
    assert config.max_position_embeddings == 4 * base_config.max_position_embeddings
    assert torch.allclose(scaled.inv_freq, base.inv_freq / 4)


def test_yarn_keeps_the_original_context_and_scales_attention(tiny_assets, tmp_path):
    base_config, base = rotary(tiny_assets, tmp_path)
    original = base_config.max_position_embeddings
    config, scaled = rotary(tiny_assets, tmp_path, rope_scaling={"rope_type": "yarn", "factor": 8.0})
    assert config.rope_parameters["original_max_position_embeddings"] == original
    assert config.max_position_embeddings == 8 * original
    assert scaled.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1.0)
    assert not torch.equal(scaled.inv_freq, base.inv_freq)


def test_a_bad_rope_scaling_is_refused_by_the_recipe(tiny_assets, tmp_path):
    from llmtrain.errors import RecipeError

    with pytest.raises(RecipeError, match="model.rope_scaling.factor"):
        load_recipe(write_recipe(tiny_assets, tmp_path, model={"rope_scaling": {"rope_type": "yarn", "factor": 0.5}}))
    with pytest.raises(RecipeError, match="rope_type"):
        load_recipe(write_recipe(tiny_assets, tmp_path, model={"rope_scaling": {"rope_type": "ntk", "factor": 2}}))


def test_the_context_warning_goes_once_the_scaled_context_covers_max_seq_len(tiny_assets, tmp_path):
    """max_seq_len past the tiny model's positions is warned in train.log; with a factor that covers it, it is not."""
    config, _ = rotary(tiny_assets, tmp_path)
    long = config.max_position_embeddings * 2
    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": long}, train={"max_steps": 1})
    run_train(recipe)
    assert "warning (context)" in (tmp_path / "run" / "train.log").read_text()
    run_train(recipe, "model.rope_scaling.rope_type=linear", "model.rope_scaling.factor=2", overwrite=True)
    assert "warning (context)" not in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("scaling, missing", [({"rope_type": "llama3", "factor": 8}, "low_freq_factor and "
                                                "high_freq_factor"),
                                               ({"rope_type": "longrope", "factor": 4}, "short_factor and long_factor")])
def test_a_type_without_its_own_fields_is_asked_for_them_by_the_recipe(tiny_assets, tmp_path, scaling, missing):
    """llama3 and longrope read fields of their own (transformers' required keys): without them the model's build
    ended in a KeyError (74 lines); the recipe now names them, with an example."""
    from llmtrain.errors import RecipeError

    with pytest.raises(RecipeError, match=f"rope_type {scaling['rope_type']} also needs {missing}"):
        load_recipe(write_recipe(tiny_assets, tmp_path, model={"rope_scaling": scaling}))


def test_llama3_and_longrope_with_their_fields_build_the_scaled_rotary_embedding(tiny_assets, tmp_path):
    base_config, base = rotary(tiny_assets, tmp_path)
    config, llama3 = rotary(tiny_assets, tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8,
                                                                 "low_freq_factor": 1, "high_freq_factor": 4})
    assert config.max_position_embeddings == 8 * base_config.max_position_embeddings
    assert not torch.equal(llama3.inv_freq, base.inv_freq) and torch.all(llama3.inv_freq <= base.inv_freq)
    half = base_config.hidden_size // base_config.num_attention_heads // 2
    _, longrope = rotary(tiny_assets, tmp_path, rope_scaling={"rope_type": "longrope", "factor": 4,
                                                              "short_factor": [1.0] * half, "long_factor": [2.0] * half})
    assert longrope.inv_freq.shape == base.inv_freq.shape
