"""NEFTune (train.neftune_alpha): the noise against transformers' own hook, each example's scale in packed and
padded rows, nothing in eval mode, an exact resume, and the modes and layouts that refuse it."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from helpers import REPO, crash_at_step, load_weights, max_abs_diff, records, run_train, write_recipe

from llmtrain.config import load_recipe
from llmtrain.model.neftune import attach_neftune

pytestmark = pytest.mark.long(60)  # tests/conftest.py


def _model(tiny_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32,
                                                attn_implementation="eager").train()


def _embedded(model, seed: int = 0, **inputs) -> torch.Tensor:
    """The input embeddings the decoder's layers receive (the hooks registered before this one applied)."""
    out = {}
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, o: out.setdefault("x", o))
    torch.manual_seed(seed)
    with torch.no_grad():
        model.model(**inputs)
    handle.remove()
    return out["x"]


def test_unpadded_rows_get_transformers_own_noise(tiny_assets):
    """Rows of one length, no padding: the noise transformers' neftune_post_forward_hook draws (TRL's SFTTrainer's),
    the same draws from the same seed, to float rounding."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    ids = torch.randint(5, 90, (3, 12), generator=torch.Generator().manual_seed(1))
    ours, theirs = _model(tiny_assets), _model(tiny_assets)
    attach_neftune(ours, 5.0)
    theirs.get_input_embeddings().neftune_noise_alpha = 5.0
    theirs.get_input_embeddings().register_forward_hook(neftune_post_forward_hook)
    got, want = _embedded(ours, input_ids=ids), _embedded(theirs, input_ids=ids)
    clean = ours.get_input_embeddings().weight[ids]
    assert (want - clean).abs().max().item() > 0.5 * 5 / math.sqrt(12 * clean.shape[-1])  # the noise is there
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_each_example_of_a_packed_or_padded_row_is_scaled_by_its_own_length(tiny_assets):
    """A packed row of examples of 3 and 13 tokens: each token's noise within alpha / sqrt(L d) of its own example, and
    reaching near it (the largest of 3 x d uniform draws); Hugging Face's hook would scale both by the row's 16. Padded
    rows: each row by its real tokens."""
    model = _model(tiny_assets)
    attach_neftune(model, 5.0)
    d = model.config.hidden_size
    ids = torch.randint(5, 90, (1, 16), generator=torch.Generator().manual_seed(2))
    packed = {"input_ids": ids, "position_ids": torch.cat([torch.arange(3), torch.arange(13)])[None],
              "cu_seq_lens_q": torch.tensor([0, 3, 16]), "cu_seq_lens_k": torch.tensor([0, 3, 16]),
              "max_length_q": 13, "max_length_k": 13}
    noise = _embedded(model, **packed) - model.get_input_embeddings().weight[ids]
    for part, length in ((noise[0, :3], 3), (noise[0, 3:], 13)):
        bound = 5 / math.sqrt(length * d)
        assert 0.95 * bound < part.abs().max().item() <= bound * (1 + 1e-6)
    mask = torch.tensor([[1] * 16, [1] * 4 + [0] * 12])
    noise = _embedded(model, input_ids=ids.repeat(2, 1), attention_mask=mask) - model.get_input_embeddings().weight[ids]
    for row, length in ((0, 16), (1, 4)):
        bound = 5 / math.sqrt(length * d)
        assert 0.95 * bound < noise[row, :4].abs().max().item() <= bound * (1 + 1e-6)


def test_eval_mode_adds_nothing(tiny_assets):
    model = _model(tiny_assets)
    attach_neftune(model, 5.0)
    ids = torch.randint(5, 90, (2, 8), generator=torch.Generator().manual_seed(3))
    model.eval()
    assert torch.equal(_embedded(model, input_ids=ids), model.get_input_embeddings().weight[ids])


def test_a_run_trains_with_the_noise_and_resumes_exactly(tiny_assets, tmp_path, monkeypatch):
    """The first step's loss is already the noisy forward's (not the plain run's); killed in step 4 and resumed from
    step 2's checkpoint, the noise draws come back with the random state: the same losses, evals and weights as the
    run never stopped."""
    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 4, "eval_every_steps": 2},
                          checkpoint={"every_steps": 2, "keep_last": 2})
    run_train(recipe, f"output_dir={tmp_path / 'plain'}")
    run_train(recipe, f"output_dir={tmp_path / 'straight'}", "train.neftune_alpha=15")
    crash_at_step(monkeypatch, recipe, 4, f"output_dir={tmp_path / 'killed'}", "train.neftune_alpha=15")
    run_train(recipe, f"output_dir={tmp_path / 'killed'}", "train.neftune_alpha=15", resume="auto")
    plain, straight, resumed = (records(tmp_path / n) for n in ("plain", "straight", "killed"))
    assert abs(straight[0]["loss"] - plain[0]["loss"]) > 1e-4
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert records(tmp_path / "killed", "eval") == records(tmp_path / "straight", "eval")
    weights = "final/model.safetensors"
    assert max_abs_diff(load_weights(tmp_path / "killed" / weights), load_weights(tmp_path / "straight" / weights)) == 0


def test_a_sequence_groups_slices_draw_the_whole_rows_noise(tiny_assets):
    """Sequence parallelism: each of 2 processes holds half of a packed row (examples of 5 and 11 tokens, the second
    across the cut) and, from the same random state, draws the whole row's noise and keeps its half: the halves put
    together are the noise one process adds to the whole row, each example scaled by its whole length (a slice that
    scaled by what it holds would scale the second example by 3 and 8); the random state ends where one process's
    does. A pipeline's first stage, which embeds outside the decoder, hands the row's examples to the hook first."""
    from llmtrain.model.neftune import Noise

    d, alpha = 8, 5.0
    cu = torch.tensor([0, 5, 16])
    embedding = torch.nn.Embedding(90, d).train()
    ids = torch.randint(5, 90, (1, 16), generator=torch.Generator().manual_seed(4))
    clean = embedding(ids)

    def noisy(noise, part, shape):
        noise.read(shape, {"cu_seq_lens_q": cu})
        return noise(embedding, (), clean[:, part]) - clean[:, part]

    def group() -> torch.Tensor:  # each process's half of the row from the same random state, put together
        halves = []
        for rank in (0, 1):
            torch.manual_seed(0)
            halves.append(noisy(Noise(alpha, (rank, 2)), slice(8 * rank, 8 * rank + 8), (1, 8)))
        return torch.cat(halves, dim=1)

    torch.manual_seed(0)
    whole = noisy(Noise(alpha), slice(None), (1, 16))
    after = torch.rand(1)
    assert torch.equal(group(), whole) and torch.equal(torch.rand(1), after)
    for part, length in ((whole[0, :5], 5), (whole[0, 5:], 11)):
        bound = alpha / math.sqrt(length * d)
        assert 0.9 * bound < part.abs().max().item() <= bound * (1 + 1e-6)
    # a row of 15 tokens padded to 16 (a group of 2's multiple, or a stage's slots): the padding had drawn noise too,
    # so the next draw was not one process's (audit 28); now the 15 tokens' noise is one process's, the padding's 0
    cu = torch.tensor([0, 5, 15])
    torch.manual_seed(0)
    one = noisy(Noise(alpha), slice(0, 15), (1, 15))
    after = torch.rand(1)
    padded = group()
    assert torch.equal(torch.rand(1), after)
    assert torch.equal(padded[:, :15], one) and not padded[:, 15:].any()


def test_other_modes_refuse_it(tiny_assets, tmp_path):
    """NEFTune is supervised fine-tuning's; every layout takes it (the sequence, tensor and pipeline layouts refused it
    before: tests/test_sequence_parallel.py, test_tp.py and test_pipeline.py train it there)."""
    from llmtrain.doctor import check_layout
    from llmtrain.errors import RecipeError

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n')
    dpo = write_recipe(tiny_assets, tmp_path, name="dpo.yaml", data={"path": str(pairs), "format": "preference"},
                       preference={"loss": "dpo"})
    with pytest.raises(RecipeError, match=r"train.neftune_alpha=5: NEFTune's noise is for supervised fine-tuning, "
                                          r"and this recipe trains preference pairs \(preference:\)"):
        load_recipe(dpo, ["train.neftune_alpha=5"])
    sft = write_recipe(tiny_assets, tmp_path)
    pipeline = ["parallel.pipeline_parallel=2", "train.micro_batch_size=1", "train.micro_batch_tokens=64",
                "train.grad_accum_steps=2"]
    for layout in (["parallel.sequence_parallel=2"], pipeline):
        assert load_recipe(sft, ["train.neftune_alpha=5", "model.attn_implementation=auto", *layout]
                           ).train.neftune_alpha == 5
    recipe = load_recipe(sft, ["train.neftune_alpha=5"])
    for config in ("cpu_tp", "cpu_ddp"):
        launch = yaml.safe_load((REPO / "accelerate_configs" / f"{config}.yaml").read_text())
        assert [status for _, status, _ in check_layout(recipe, launch)] == ["pass"]


class _Embedded(Exception):
    """Raised by _first_embedding's hook: the embedding's output is all the test reads (a sequence slice's decoder
    would need its group's all-to-all)."""


def _first_embedding(model, batch: dict, seed: int = 0) -> torch.Tensor:
    """The noisy input embeddings of `batch` as training's loss forward (model/loss.py compute_loss) makes them."""
    from llmtrain.model.loss import compute_loss

    def stop(module, args, output):
        raise _Embedded(output)

    handle = model.get_input_embeddings().register_forward_hook(stop)
    torch.manual_seed(seed)
    try:
        compute_loss(model, batch)
    except _Embedded as e:
        return e.args[0].detach()
    finally:
        handle.remove()
    raise AssertionError("the embedding was not called")


def test_a_sequence_slice_of_a_row_the_group_pads_draws_one_process_noise(tiny_assets):
    """A packed row of 17 tokens under a sequence group of 2 is padded to 18 with one more segment, which the row's
    boundaries cannot tell from an example: each process drew noise for it too, moving the random stream on, so every
    later row's noise was another than one process's (audit 38: step 4's loss 4.6535 against 4.6180). The slice says
    its row's real tokens (`row_tokens`): the two halves' noise is one process's, the padding's 0, and the next draw
    from the random stream is the same."""
    from llmtrain.data.batching import Counts, collate, with_loss_positions
    from llmtrain.model.loss import attach_loss
    from llmtrain.parallel.sequence.shards import shard_batch

    examples, token = [], 10
    for n in (3, 6, 8):
        ids = list(range(token, token + n))
        token += n
        examples.append({"input_ids": ids, "labels": [-100] + ids[1:]})
    batch = with_loss_positions(collate(examples, pad_id=0, packing=True))
    counts = Counts(units=14.0, trained=14.0, tokens=17.0, squares=109.0)

    def noisy(rank: int, size: int):
        model = _model(tiny_assets)
        attach_loss(model, chunk=64)
        attach_neftune(model, 5.0, sequence=(rank, size))
        part = batch if size == 1 else shard_batch(batch, counts, size=size, rank=rank, pad_id=0)[0]
        embedded = _first_embedding(model, part)
        return embedded - model.get_input_embeddings().weight[part["input_ids"]].detach(), torch.rand(1)

    (one, after_one), halves = noisy(0, 1), [noisy(r, 2) for r in range(2)]
    whole = torch.cat([h for h, _ in halves], dim=1)
    assert whole.shape[1] == 18 and one.abs().max().item() > 0
    torch.testing.assert_close(whole[:, :17], one, atol=0, rtol=0)
    assert whole[:, 17].abs().max().item() == 0  # the padding's
    assert all(torch.equal(after, after_one) for _, after in halves)  # the stream moved on as one process's
