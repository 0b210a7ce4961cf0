"""model.rope_scaling reaches the model: its config, max_position_embeddings and the rotary embedding it builds,
and the context check then takes the scaled length."""

from __future__ import annotations

import json

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


def test_dynamic_ntk_rescales_past_the_original_context_as_transformers_does(tiny_assets, tmp_path):
    """transformers' dynamic NTK reads max_position_embeddings as the original length and rescales past it; raised to
    original x factor, every position up to it ran on the plain RoPE (logits equal to no scaling at 3x the model's
    context). The context checks take its reach, original x factor."""
    from transformers import AutoModelForCausalLM

    from llmtrain.model.modeling import context_reach

    base_config, _ = rotary(tiny_assets, tmp_path)
    original = base_config.max_position_embeddings
    config, scaled = rotary(tiny_assets, tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    assert config.max_position_embeddings == original and context_reach(config) == 4 * original
    theirs_config = AutoModelForCausalLM.from_pretrained(tiny_assets / "model").config
    theirs_config.rope_parameters = {**theirs_config.rope_parameters, "rope_type": "dynamic", "factor": 4.0}
    theirs = AutoModelForCausalLM.from_config(theirs_config).model.rotary_emb
    x = torch.zeros(1, 3 * original, 1)
    positions = torch.arange(3 * original)[None]
    ours_cos, _ = scaled(x, positions)
    theirs_cos, _ = theirs(x, positions)
    plain_cos, _ = rotary(tiny_assets, tmp_path)[1](x, positions)
    torch.testing.assert_close(ours_cos, theirs_cos)
    assert (ours_cos - plain_cos).abs().max() > 0.1  # it had been the plain RoPE's, to the bit


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


def test_a_runs_final_model_and_its_merged_export_keep_the_rotary_embedding_it_trained_with(tiny_assets, tmp_path):
    """A full fine-tune with yarn x 4: final/ saves the scaled config, and `llmtrain generate` (run/replies.load_source,
    the run's recipe on final/) builds the rotary embedding training built (scale_rope had scaled final/'s already
    scaled length again: original 2,048 for 512, other frequencies). A LoRA run with linear x 4: `export --merge`
    reads the base again and scales it as the run did (its merged config had the base's 512 positions and
    unscaled frequencies)."""
    from llmtrain.run.export import export_merged
    from llmtrain.run.replies import load_source

    yarn = {"rope_type": "yarn", "factor": 4.0}
    full = write_recipe(tiny_assets, tmp_path, name="full.yaml", model={"rope_scaling": yarn},
                        train={"max_steps": 1}, output_dir=str(tmp_path / "full"))
    run_train(full)
    trained = load_model(load_recipe(full).model, None)
    replied = load_source(str(tmp_path / "full")).model
    assert replied.config.rope_parameters["original_max_position_embeddings"] == 512
    assert replied.config.max_position_embeddings == trained.config.max_position_embeddings == 2048
    assert torch.equal(replied.model.rotary_emb.inv_freq, trained.model.rotary_emb.inv_freq)

    lora = write_recipe(tiny_assets, tmp_path, name="lora.yaml", lora={"r": 4},
                        model={"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, train={"max_steps": 1},
                        output_dir=str(tmp_path / "lora"))
    run_train(lora)
    merged = export_merged(tmp_path / "lora", say=lambda _: None)
    config = json.loads((merged / "config.json").read_text())
    assert config["max_position_embeddings"] == 2048
    assert config["rope_parameters"]["rope_type"] == "linear" and config["rope_parameters"]["factor"] == 4.0
    # `llmtrain eval` of that run hands the harness the model built as generate builds it, not the unscaled base
    from llmtrain.run.benchmarks import resolve

    target = resolve(str(tmp_path / "lora"), dtype="auto")
    assert "RoPE linear x 4" in target.name and target.load is not None
    model, _ = target.load("cpu")
    assert model.get_base_model().config.max_position_embeddings == 2048


def test_scaling_keeps_a_partial_rotary_models_share_of_each_head():
    """Phi-3 and Phi-4-mini rotate part of each head (rope_parameters' partial_rotary_factor): model.rope_scaling had
    replaced their rope_parameters without it, so every head dimension was rotated, silently another model (the
    review of audit 47). Kept now, unless the scaling gives its own; and the recipe takes the key for every type."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from llmtrain.config import RopeScaling
    from llmtrain.model.modeling import scale_rope

    config = Phi3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                        num_hidden_layers=2, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        partial_rotary_factor=0.75)
    scale_rope(config, RopeScaling(rope_type="linear", factor=2.0))
    assert config.rope_parameters["partial_rotary_factor"] == 0.75
    assert Phi3RotaryEmbedding(config).inv_freq.numel() == int(32 * 0.75) // 2  # head_dim 32, 3/4 of it rotated
    own = RopeScaling(rope_type="yarn", factor=4.0, partial_rotary_factor=0.5)
    config = Phi3Config(partial_rotary_factor=0.75)
    scale_rope(config, own)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
