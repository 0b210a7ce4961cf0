"""Preference tuning (data.format: preference, the preference: section): the losses against values worked out by
hand and against TRL's DPOTrainer; the three data shapes and their refusals; the padding-free pairs against padded
ones, accumulation against a larger micro-batch; the LoRA reference at the first step; exact resume with a
precomputed reference; and a short run whose held-out reward accuracy rises (GSM8K-derived pairs)."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal

import pytest
import torch
from conftest import GSM8K, needs
from helpers import REPO, crash_at_step, load_weights, max_abs_diff, records, run_train

from llmtrain.config import DataConfig, PreferenceConfig
from llmtrain.data.formats import encode_example
from llmtrain.data.pairs import encode_pair, split_pair
from llmtrain.data.prepare import prepare_datasets
from llmtrain.errors import LLMTrainError, RecipeError
from llmtrain.objectives.preference import Preference, f_score, ld_weights, pair_losses, pairs_loss, sequence_logps

PAIRS = [
    {"prompt": "reverse abc =", "chosen": " cba", "rejected": " abc"},
    {"prompt": "reverse hello =", "chosen": " olleh", "rejected": " hello"},
    {"prompt": "reverse xy =", "chosen": " yx", "rejected": " xyy"},
    {"prompt": "reverse stop =", "chosen": " pots", "rejected": " spot"},
]


pytestmark = pytest.mark.long(120)  # tests/conftest.py


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reversal_pairs(tiny_assets, n: int) -> list[dict]:
    """Pairs from the tiny reversal task: chosen the reversed string, rejected the string as given."""
    rows = [json.loads(line) for line in (tiny_assets / "data" / "train.jsonl").read_text().splitlines()[:n]]
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": " " + r["prompt"].split()[1]}
            for r in rows if r["completion"].strip() != r["prompt"].split()[1]]


LORA_OVERRIDES = ["lora.r=4", "lora.alpha=8", "lora.dropout=0.0", "train.lr=1e-2"]


def _pref_recipe(tiny_assets, folder):
    from helpers import write_recipe

    data = write_jsonl(folder / "pairs.jsonl", reversal_pairs(tiny_assets, 400))
    return write_recipe(tiny_assets, folder, data={"path": str(data), "format": "preference", "max_seq_len": 32,
                                                   "eval_split": 0.1},
                        preference={"loss": "dpo", "beta": 0.1},
                        train={"max_steps": 6, "micro_batch_size": 8, "lr": 1e-3, "warmup_steps": 0, "seed": 7})


def test_lora_dropout_is_off_by_default_as_trls_dpo_trainer_turns_it_off(tiny_assets, tmp_path):
    """TRL's DPOTrainer (and KTOTrainer, RewardTrainer) default disable_dropout=True: every dropout off, peft's
    lora_dropout too. llmtrain had trained with lora.dropout's 0.05 (audit 26). train.disable_dropout resolves from
    the capability table: on for these modes, off for SFT; a LoRA DPO run with lora.dropout 0.05 now trains what one
    with 0 trains, and `train.disable_dropout: false` brings the dropout back."""
    from llmtrain.config import load_recipe

    recipe = _pref_recipe(tiny_assets, tmp_path)
    lora = ["lora.r=4", "lora.alpha=8", "train.lr=1e-2", "train.max_steps=3", "data.eval_split=null"]
    assert load_recipe(recipe, lora).train.disable_dropout is True
    assert load_recipe(REPO / "recipes" / "tiny.yaml").train.disable_dropout is False
    assert load_recipe(REPO / "recipes" / "tiny-grpo.yaml").train.disable_dropout is False

    def losses(*more):
        run = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        run_train(recipe, *lora, *more, f"output_dir={run}")
        return [r["loss"] for r in records(run)]

    default, none, kept = losses("lora.dropout=0.05"), losses("lora.dropout=0.0"), losses(
        "lora.dropout=0.05", "train.disable_dropout=false")
    assert default == pytest.approx(none, abs=1e-6)
    assert abs(kept[-1] - none[-1]) > 1e-4  # dropout on: another run


def test_disable_dropout_turns_a_configs_attention_dropout_off_too(tiny_assets):
    """transformers' attention modules keep the config's attention_dropout as a float and hand it to the attention
    function in training: train.disable_dropout had left it on (nn.Dropout modules alone), so a checkpoint with
    attention dropout trained DPO with it, and on CUDA the varlen kernel refused it at the first step."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model.modeling import dropout_off

    config = AutoConfig.from_pretrained(tiny_assets / "model")
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    ids = torch.arange(4, 36).view(2, 16)
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout in each forward
    dropout_off(model)
    assert torch.equal(model(ids).logits, model(ids).logits)


@pytest.fixture
def pref_recipe(tiny_assets, tmp_path):
    return _pref_recipe(tiny_assets, tmp_path)


@pytest.fixture(scope="module")
def one_process(tiny_assets, tmp_path_factory):
    """`one_process(lora)` -> (recipe, run): the preference recipe's run on 1 process, full or LoRA, made once for
    the module's launches to compare with."""
    folder, made = tmp_path_factory.mktemp("pref-one"), set()
    recipe = _pref_recipe(tiny_assets, folder)

    def get(lora: bool):
        run = folder / ("lora" if lora else "full")
        if lora not in made:
            run_train(recipe, f"output_dir={run}", *(LORA_OVERRIDES if lora else []))
            made.add(lora)
        return recipe, run

    return get


# --------------------------------------------------------------------------- the losses, by hand


def test_losses_equal_values_worked_out_by_hand():
    t = torch.tensor
    pc, pr, rc, rr, nc, nr = t([-10.0]), t([-12.0]), t([-11.0]), t([-11.0]), t([2.0]), t([4.0])
    loss, chosen, rejected = pair_losses("dpo", pc, pr, rc, rr, nc, nr, beta=0.1)
    # log-ratios +1 and -1: -log sigmoid(0.1 * 2) = log(1 + e^-0.2)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.2)), abs=1e-7) == pytest.approx(0.5981388693)
    assert (chosen.item(), rejected.item()) == pytest.approx((0.1, -0.1))
    loss, _, _ = pair_losses("ipo", pc, pr, rc, rr, nc, nr, beta=0.1)
    assert loss.item() == pytest.approx((1 / 2 - (-1) / 4 - 1 / (2 * 0.1)) ** 2) == pytest.approx(18.0625)
    loss, chosen, rejected = pair_losses("simpo", t([-4.0]), pr, None, None, nc, nr, beta=2.0, gamma=0.5)
    # per-token log-probs -2 and -3, rewards -4 and -6: -log sigmoid(2 - 0.5)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1.5)), abs=1e-7)
    assert (chosen.item(), rejected.item()) == pytest.approx((-4.0, -6.0))


def test_orpo_is_the_chosen_nll_plus_beta_times_the_odds_ratio_loss():
    """ORPO (Hong et al. 2024) from each answer's mean log-probability per token: probabilities e^-1 and e^-3, odds
    p / (1 - p), the loss -(-1) - beta log sigmoid(log odds ratio), worked out by hand; no reference. An answer whose
    every token has probability 1 (mean log-probability 0) gives a finite loss and gradient, not log 0's NaN."""
    t = torch.tensor
    pc, pr, nc, nr = t([-2.0]), t([-12.0]), t([2.0]), t([4.0])
    loss, chosen, rejected = pair_losses("orpo", pc, pr, None, None, nc, nr, beta=0.25)
    odds = lambda p: p / (1 - p)  # noqa: E731
    ratio = math.log(odds(math.exp(-1)) / odds(math.exp(-3)))
    assert loss.item() == pytest.approx(1 + 0.25 * math.log(1 + math.exp(-ratio)), abs=1e-6)
    assert (chosen.item(), rejected.item()) == pytest.approx((-0.25, -0.75))
    sure = t([0.0], requires_grad=True)
    loss, _, _ = pair_losses("orpo", sure, pr, None, None, nc, nr, beta=0.25)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(sure.grad.item())


def test_orpo_is_reference_free_and_holds_its_nll_term_already():
    from llmtrain.objectives.objective import reference_kind

    assert PreferenceConfig(loss="orpo").reference == "auto"
    recipe = type("R", (), {"preference": PreferenceConfig(loss="orpo"), "lora": None,
                            "parallel": type("P", (), {"pipeline_parallel": 1})()})()
    assert reference_kind(recipe) == "none"  # no reference pass, no second model, LoRA or full
    with pytest.raises(ValueError, match="orpo is reference-free; leave preference.reference at auto"):
        PreferenceConfig(loss="orpo", reference="precomputed")
    with pytest.raises(ValueError, match="orpo's loss holds the chosen answers' negative log-likelihood already"):
        PreferenceConfig(loss="orpo", sft_weight=0.2)


def test_label_smoothing_is_refused_where_no_loss_reads_it_and_asked_for_where_exo_takes_its_log():
    assert PreferenceConfig(loss="robust", label_smoothing=0.1).label_smoothing == 0.1
    with pytest.raises(ValueError, match="preference.label_smoothing is read by preference.loss robust, exo_pair, "
                                         "aot, aot_unpaired, and this recipe's loss is dpo"):
        PreferenceConfig(loss="dpo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="exo_pair takes log.label_smoothing.: set preference.label_smoothing"):
        PreferenceConfig(loss="exo_pair")
    # robust with no flipped labels is dpo
    c, r = torch.tensor([0.3, -1.2]), torch.tensor([0.1, 0.4])
    n = torch.tensor([3.0, 2.0])
    robust, _, _ = pair_losses("robust", c, r, torch.zeros(2), torch.zeros(2), n, n, beta=0.5)
    dpo, _, _ = pair_losses("dpo", c, r, torch.zeros(2), torch.zeros(2), n, n, beta=0.5)
    assert torch.allclose(robust, dpo)


def test_f_divergences_and_their_alpha_are_refused_where_nothing_reads_them():
    """f-DPO's divergence on losses whose log Z(x) does not cancel, alpha without alpha_divergence, alpha 1 (the
    reverse KL) and WPO's pair weights on aot's sorted losses are refused naming the field; alpha_divergence's alpha
    is TRL's 0.5 unless given. Its score at 0 is the forward KL's and at alpha -> 1 the log-ratio."""
    assert PreferenceConfig(f_divergence="alpha_divergence").f_alpha == 0.5
    assert PreferenceConfig(loss="ipo", f_divergence="js_divergence").f_alpha is None
    with pytest.raises(ValueError, match="preference.f_divergence=forward_kl regularises the losses built on the "
                                         "chosen-rejected difference .* this recipe's loss is bco_pair"):
        PreferenceConfig(loss="bco_pair", f_divergence="forward_kl")
    with pytest.raises(ValueError, match="f_divergence=js_divergence .* loss is simpo"):
        PreferenceConfig(loss="simpo", f_divergence="js_divergence")
    with pytest.raises(ValueError, match="preference.f_alpha is alpha_divergence's alpha, and this recipe's "
                                         "f_divergence is forward_kl: remove it"):
        PreferenceConfig(f_divergence="forward_kl", f_alpha=0.3)
    with pytest.raises(ValueError, match="f_alpha=1 makes the alpha divergence the reverse KL"):
        PreferenceConfig(f_divergence="alpha_divergence", f_alpha=1.0)
    with pytest.raises(ValueError, match="preference.wpo weighs each pair's loss, and aot_unpaired sorts"):
        PreferenceConfig(loss="aot_unpaired", wpo=True)
    u = torch.tensor([-2.0, -0.1, 0.0, 0.7, 3.0])
    assert torch.allclose(f_score(u, "alpha_divergence", 0.0), f_score(u, "forward_kl", None))
    assert torch.allclose(f_score(u, "alpha_divergence", 1 - 1e-4), u, atol=1e-3)
    assert torch.allclose(f_score(u, "js_divergence", None), torch.log(2 * torch.exp(u) / (torch.exp(u) + 1)))


def test_a_list_of_losses_is_their_weighted_sum_and_its_mistakes_are_refused_naming_the_key():
    """preference.loss as a list (MPO's mix): each loss's pair losses times its weight, summed; the rewards are the
    single losses'. A list of one is that loss; a reference-free loss in a list, a loss named twice, weights of the
    wrong count or not above 0, weights for a single loss, and a misspelt name are refused with the key."""
    c, r = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.5])
    rc, rr, n = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -3.0]), torch.tensor([2.0, 3.0])
    cfg = PreferenceConfig(loss=["dpo", "bco_pair"], loss_weights=[0.8, 0.2])
    logps, tokens = torch.stack([c, r], 1).flatten(), torch.stack([n, n], 1).flatten()
    loss, stats = pairs_loss(cfg, logps, tokens, rc, rr)
    want = sum(w * pair_losses(k, c, r, rc, rr, n, n, beta=0.1)[0].sum() for k, w in (("dpo", 0.8), ("bco_pair", 0.2)))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert stats.tolist() == pytest.approx(pairs_loss(PreferenceConfig(), logps, tokens, rc, rr)[1].tolist())
    assert PreferenceConfig(loss=["ipo"]).loss == "ipo"
    for kw, message in (({"loss": ["dpo", "simpo"]}, "preference.loss simpo is reference-free and trains alone"),
                        ({"loss": ["dpo", "dpo"]}, "preference.loss names a loss twice"),
                        ({"loss": ["dpo", "hinge"], "loss_weights": [1.0]}, "gives 1 weights for the 2 losses"),
                        ({"loss": ["dpo", "hinge"], "loss_weights": [1.0, 0.0]}, "must be finite and above 0"),
                        ({"loss": "dpo", "loss_weights": [1.0]}, "this recipe names one loss"),
                        ({"loss": ["dpo", "bco_pai"]}, "unknown loss 'bco_pai' .did you mean bco_pair.")):
        with pytest.raises(ValueError, match=message):
            PreferenceConfig(**kw)


def test_ld_weights_count_each_answers_tokens_past_the_shorter_answer_alpha_times():
    """LD-DPO's weights by hand: pairs of 3 and 5 trained tokens (the rejected's last two weigh alpha), 2 and 2
    (none), 4 and 1 (the chosen's last three)."""
    tokens = torch.tensor([3.0, 5.0, 2.0, 2.0, 4.0, 1.0])
    sequence = torch.repeat_interleave(torch.arange(6), tokens.long())
    a = 0.25
    assert ld_weights(sequence, tokens, a).tolist() == [1, 1, 1, 1, 1, 1, a, a, 1, 1, 1, 1, 1, a, a, a, 1]


def test_aot_sorts_the_micro_batchs_margins_so_a_pairing_does_not_change_its_loss():
    """aot's loss reads the batch's sorted margins: pairing the policy's margins with other pairs' reference margins
    leaves it unchanged, where dpo's changes; aot_unpaired reads the sorted chosen and rejected log-ratios apart."""
    c, r = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -2.5, -6.0])
    rc, rr = torch.tensor([-3.5, -4.0, -3.0]), torch.tensor([-3.0, -3.0, -5.0])
    n = torch.ones(3)
    perm = torch.tensor([2, 0, 1])
    for kind, changes in (("aot", False), ("dpo", True)):
        a, _, _ = pair_losses(kind, c, r, rc, rr, n, n, beta=0.5)
        b, _, _ = pair_losses(kind, c, r, rc[perm], rr[perm], n, n, beta=0.5)
        assert (abs(a.sum() - b.sum()).item() > 1e-3) is changes
    loss, _, _ = pair_losses("aot_unpaired", c, r, rc, rr, n, n, beta=0.5, smoothing=0.1)
    delta = torch.sort(c - rc).values - torch.sort(r - rr).values
    want = 0.9 * -torch.nn.functional.logsigmoid(0.5 * delta) + 0.1 * -torch.nn.functional.logsigmoid(-0.5 * delta)
    assert torch.allclose(loss, want)


# --------------------------------------------------------------------------- data


def test_the_sft_term_adds_each_chosen_answers_mean_nll_per_token_to_its_pair():
    """preference.sft_weight (RPO): per pair, not per micro-batch token, so two pairs of unequal chosen lengths weigh
    the same whatever micro-batch they share."""
    from llmtrain.objectives.preference import pairs_loss

    t = torch.tensor
    logps, tokens = t([-10.0, -12.0, -6.0, -9.0]), t([2.0, 4.0, 3.0, 3.0])  # chosen, rejected of two pairs
    ref_c, ref_r = t([-11.0, -6.5]), t([-11.0, -8.0])
    plain, stats = pairs_loss(PreferenceConfig(beta=0.1), logps, tokens, ref_c, ref_r)
    loss, same = pairs_loss(PreferenceConfig(beta=0.1, sft_weight=0.2), logps, tokens, ref_c, ref_r)
    assert loss.item() == pytest.approx(plain.item() + 0.2 * (10 / 2 + 6 / 3))  # not 0.2 x 2 x 16 / 5
    assert torch.equal(stats, same)  # rewards and accuracies are the preference's alone
    with pytest.raises(ValueError, match="sft_weight"):
        PreferenceConfig(sft_weight=-0.1)


def test_three_shapes_render_each_answer_as_sft_renders_the_row(tiny_tok):
    cfg = DataConfig(path="x.jsonl", format="preference", chat_template=True)
    sft = DataConfig(path="x.jsonl", format="prompt_completion", chat_template=True)
    strings = {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."}
    conversational = {"prompt": [{"role": "user", "content": "Hi?"}],
                      "chosen": {"role": "assistant", "content": "Hello."},
                      "rejected": [{"role": "assistant", "content": "Go away."}]}
    implicit = {"chosen": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
                "rejected": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Go away."}]}
    assert split_pair(implicit, cfg)[0] == [{"role": "user", "content": "Hi?"}]
    encoded = [encode_pair(row, tiny_tok, cfg) for row in (strings, conversational, implicit)]
    assert encoded[0] == encoded[1] == encoded[2]
    for side in ("chosen", "rejected"):
        row = encode_example({"prompt": "Hi?", "completion": strings[side]}, tiny_tok, sft)
        assert encoded[0][f"{side}_ids"] == row["input_ids"] and encoded[0][f"{side}_labels"] == row["labels"]
    trained = [i for i, lab in zip(encoded[0]["chosen_ids"], encoded[0]["chosen_labels"]) if lab != -100]
    assert tiny_tok.decode(trained) == "Hello.</s>"  # the answer and its end of turn, nothing of the prompt


def test_an_explicit_prompt_is_kept_before_the_messages_the_answers_share(tiny_tok):
    """A prompt column of messages beside answers that share their first messages: the shared messages had replaced
    the prompt, the user's question lost (audit 29). They follow it now; where the answers repeat the prompt (its
    messages, or ultrafeedback_binarized's text as their user message) they are it, as before."""
    from llmtrain.data.pairs import split_pair

    cfg = DataConfig(path="x.jsonl", format="preference", chat_template=True)
    u, sure, shorter = ({"role": "user", "content": "Tell me about cats."}, {"role": "assistant", "content": "Sure."},
                        {"role": "user", "content": "Shorter please."})
    yes, no = {"role": "assistant", "content": "Cats purr."}, {"role": "assistant", "content": "No."}
    row = {"prompt": [u], "chosen": [sure, shorter, yes], "rejected": [sure, shorter, no]}
    assert split_pair(row, cfg) == ([u, sure, shorter], [yes], [no])
    repeated = {"prompt": [u], "chosen": [u, sure, shorter, yes], "rejected": [u, sure, shorter, no]}
    assert split_pair(repeated, cfg) == ([u, sure, shorter], [yes], [no])
    ultrafeedback = {"prompt": u["content"], "chosen": [u, yes], "rejected": [u, no]}
    assert split_pair(ultrafeedback, cfg) == ([u], [yes], [no])
    as_dict = {"prompt": u, "chosen": yes, "rejected": no}  # a prompt given as one message had been its repr as text
    assert split_pair(as_dict, cfg) == ([u], [yes], [no])
    enc = encode_pair(row, tiny_tok, cfg)
    assert "Tell me about cats." in tiny_tok.decode(enc["chosen_ids"])


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "a", "chosen": "", "rejected": "b"}, "row 2: 'chosen' (chosen) is empty"),
    ({"prompt": "a", "chosen": "b", "rejectd": "c"},
     "row 2: 'rejected' (rejected) is missing (no such key, or null); the row has 'prompt', 'chosen', 'rejectd'"),
    ({"prompt": "a", "chosen": [{"role": "assistant"}], "rejected": "b"}, "row 2: the chosen messages are not all"),
    # audit 29: a number (a CSV's answer) had been a traceback; an answer without an assistant message a traceback
    # (or the pair dropped as "the same"); one answer text and the other a chat, two prompts compared silently
    ({"prompt": "What is 2+2?", "chosen": 4, "rejected": 5}, "row 2: 'chosen' (chosen) is 4, an int, not text"),
    ({"prompt": "a", "chosen": [{"role": "gpt", "content": "b"}], "rejected": [{"role": "gpt", "content": "c"}]},
     "row 2: the chosen answer has no assistant message, so nothing would be trained (roles ['gpt']"),
    ({"prompt": "q?", "chosen": "yes", "rejected": [{"role": "assistant", "content": "no"}]},
     "row 2: 'chosen' (chosen) and 'rejected' (rejected) are one text and one message list"),
])
def test_bad_pairs_are_refused_naming_file_and_row(tiny_tok, tmp_path, row, problem):
    path = write_jsonl(tmp_path / "p.jsonl", [PAIRS[0], row])
    cfg = DataConfig(path=str(path), format="preference", max_seq_len=16, cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match="^" + re.escape(f"{path}, {problem}")):
        prepare_datasets(cfg, tiny_tok, seed=0)


def test_long_prompts_are_cut_from_the_left_and_untrainable_pairs_dropped_and_reported(tiny_tok, tmp_path):
    """A prompt longer than data.max_seq_len loses its start, not the run: both answers see the same cut prompt and
    fit whole. Pairs that cannot teach (chosen equal to rejected, or equal once cut to max_seq_len) are dropped,
    counted by reason and named by row, once; the rest trains. (Each used to stop the whole run at its row.)"""
    rows = [*PAIRS,
            {"prompt": "a" * 40 + " =", "chosen": " b", "rejected": " cc"},  # row 5: the prompt is cut
            {"prompt": "q", "chosen": " same", "rejected": " same"},  # row 6: dropped
            {"prompt": "q", "chosen": " " + "x" * 30 + "1", "rejected": " " + "x" * 30 + "2"}]  # row 7: dropped
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = DataConfig(path=str(path), format="preference", max_seq_len=24, cache_dir=str(tmp_path / "c"))
    train, _, stats, _ = prepare_datasets(cfg, tiny_tok, seed=0)
    s = stats["train"]
    assert (s.examples, s.dropped, s.dropped_rows) == (5, 2, [6, 7])
    assert s.drops == {"chosen equal to rejected": 1, "with chosen and rejected the same within data.max_seq_len": 1}
    assert s.dropped_text("pairs") == ("2 of 7 pairs dropped: 1 chosen equal to rejected, 1 with chosen and rejected "
                                       "the same within data.max_seq_len (rows 6, 7)")
    cut = train[4]
    chosen, rejected = cut["chosen_ids"], cut["rejected_ids"]
    assert len(rejected) == 24 and len(chosen) == 23  # the longer answer fits exactly
    assert chosen[0] == rejected[0] == tiny_tok.bos_token_id  # BOS stays; the prompt's start goes
    assert chosen[:20] == rejected[:20] and tiny_tok.decode(chosen[1:20]) == "a" * 17 + " ="  # its end stays
    for ids, labels, answer in ((chosen, cut["chosen_labels"], " b"), (rejected, cut["rejected_labels"], " cc")):
        assert tiny_tok.decode([i for i, lab in zip(ids, labels) if lab != -100]) == answer + "</s>"
    assert s.truncated == 1  # the other pairs fit whole

    from llmtrain.data.checks import check_masks

    (warn,) = [r for r in check_masks(s, train_on_prompt=False, text=False, max_seq_len=24, unit="pairs")
               if r[0] == "dropped"]
    assert warn[1] == "warn" and warn[2].startswith("2 of 7 pairs dropped: 1 chosen equal to rejected")


def test_a_file_with_almost_nothing_to_train_stops_with_the_reasons(tiny_tok, tmp_path):
    rows = [PAIRS[0]] + [{"prompt": "q", "chosen": f" {i}", "rejected": f" {i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = DataConfig(path=str(path), format="preference", max_seq_len=24, cache_dir=str(tmp_path / "c"))
    with pytest.raises(LLMTrainError, match=re.escape(
            f"only 1 of the 11 pairs in {path} can be trained (10 of 11 pairs dropped: 10 chosen equal to rejected "
            "(rows 2, 3, 4, 5, 6, ...)). Check data.format / data.fields against the file.")):
        prepare_datasets(cfg, tiny_tok, seed=0)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())  # nothing cached


def test_preference_section_and_format_go_together(pref_recipe):
    from llmtrain.config import load_recipe

    with pytest.raises(RecipeError, match="data.format: preference and the preference: section go together"):
        load_recipe(pref_recipe, ["preference=null"])
    with pytest.raises(RecipeError, match="preference.reference: adapter disables the LoRA adapter"):
        load_recipe(pref_recipe, ["preference.reference=adapter"])


# --------------------------------------------------------------------------- the objective


def _objective_batch(tiny_assets, tiny_tok, *, packing: bool, lora: bool = False):
    from llmtrain.config import LoraConfig, ModelConfig
    from llmtrain.model.loss import attach_loss
    from llmtrain.model.modeling import load_model

    cfg = DataConfig(path="x.jsonl", format="preference")
    rows = [encode_pair(p, tiny_tok, cfg) for p in PAIRS]
    torch.manual_seed(0)
    model = load_model(ModelConfig(name_or_path=str(tiny_assets / "model"), attn_implementation="eager"),
                       LoraConfig(r=4, alpha=8, dropout=0.0) if lora else None, device=torch.device("cpu"), empty=False)
    attach_loss(model, chunk=8)
    objective = Preference(PreferenceConfig(loss="dpo", beta=0.1), pad_id=tiny_tok.pad_token_id, packing=packing,
                           reference="adapter" if lora else "none", model=model)
    batch, counts = objective.collate(rows)
    return model, objective, batch, counts


def test_lora_reference_is_the_policy_at_the_first_step_so_every_pair_costs_ln2(tiny_assets, tiny_tok):
    model, objective, batch, counts = _objective_batch(tiny_assets, tiny_tok, packing=True, lora=True)
    assert counts.units == 4
    ref = objective._reference(batch)
    logps = sequence_logps(model, batch)
    assert torch.equal(ref[0], logps[0::2]) and torch.equal(ref[1], logps[1::2])  # the adapter's B is zero
    loss, stats = objective.loss(model, batch)
    assert loss.item() == pytest.approx(4 * math.log(2), abs=1e-6)
    assert stats[:4].abs().max().item() == 0  # rewards, accuracy (0 > 0 is false) and margins are all zero


@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo", "orpo", "dpo+sft", "aot+ld", "ipo+wpo"])
def test_the_last_pipeline_stages_loss_is_the_objectives_on_the_same_row(tiny_assets, tiny_tok, kind):
    """StagePairs (the last stage's loss on pipeline stages) from the row's final hidden states and its float targets
    (each trained token's id, sequence and weight, each sequence's reference and tokens): the loss, statistics, eval
    sums and the head's gradient of Preference.loss on the same pairs (aot+ld: LD-DPO's token weights at 0.5;
    ipo+wpo: WPO's weights from the head's log sums of squares); its
    reference pass's log-probabilities are sequence_logps'; an idle row's loss is a zero that still reaches the
    head."""
    from llmtrain.data.batching import collate, with_loss_positions
    from llmtrain.model.loss import decoder_inputs
    from llmtrain.objectives.preference import StagePairs, ld_weights

    model, _, batch, counts = _objective_batch(tiny_assets, tiny_tok, packing=True)
    kind, _, extra = kind.partition("+")
    reference = "none" if kind in ("simpo", "orpo") else "precomputed"
    cfg = PreferenceConfig(loss=kind, beta=0.5, sft_weight=0.3 if extra == "sft" else 0.0,
                           ld_alpha=0.5 if extra == "ld" else None, wpo=extra == "wpo",
                           **({"reference": "precomputed"} if reference != "none" else {}))
    if extra == "ld":  # as Preference.collate adds them under this cfg
        batch = {**batch, "loss_ld_weight": ld_weights(batch["loss_example"], batch["sequence_tokens"], 0.5)}
        assert 0 < (batch["loss_ld_weight"] == 0.5).sum() < len(batch["loss_example"])
    objective = Preference(cfg, pad_id=tiny_tok.pad_token_id, packing=True, reference=reference, model=model)
    pairs = int(counts.units)
    batch = {**batch, "reference": -20.0 - torch.arange(2 * pairs, dtype=torch.float32).reshape(pairs, 2) * 1.5}
    want, want_stats = objective.loss(model, batch)
    want.backward()
    head = model.lm_head
    want_grad, head.weight.grad = head.weight.grad.clone(), None

    stage = StagePairs(cfg, reference=reference)
    tokens = batch["input_ids"].numel()
    slots = tokens + 5  # the row's padding: never read
    target = stage.targets(batch, slots)[0]
    assert target.shape == (slots, 5) and int((target[:, 3] >= 0).sum()) == 2 * pairs
    hidden = model.model(**decoder_inputs(batch)).last_hidden_state.flatten(0, 1)
    hidden = torch.cat([hidden, torch.randn(slots - tokens, hidden.shape[1])])
    got, stats = stage.loss(head, hidden, target)
    assert got.item() == pytest.approx(want.item(), abs=1e-5)
    assert stats.tolist() == pytest.approx(want_stats.tolist(), abs=1e-4)
    got.backward()
    assert torch.allclose(head.weight.grad, want_grad, atol=1e-6)
    with torch.no_grad():
        assert stage.eval_sums(head, hidden, target).tolist() == pytest.approx(
            objective.eval_sums(model, batch, torch.device("cpu")).tolist(), abs=1e-4)
        logps = stage.logps(head, hidden, target)
        assert logps.shape == (slots,) and logps[2 * pairs:].abs().max().item() == 0
        assert logps[: 2 * pairs].tolist() == pytest.approx(sequence_logps(model, batch).tolist(), abs=1e-5)
    idle = stage.targets(with_loss_positions(collate([], pad_id=0, packing=True)), slots)[0]
    loss, stats = stage.loss(head, hidden, idle)
    assert loss.item() == 0 and loss.grad_fn is not None and stats.abs().max().item() == 0


def test_packed_pairs_give_the_log_probabilities_of_padded_ones(tiny_assets, tiny_tok):
    model, _, packed, _ = _objective_batch(tiny_assets, tiny_tok, packing=True)
    _, _, padded, _ = _objective_batch(tiny_assets, tiny_tok, packing=False)
    assert "attention_mask" in padded and "cu_seq_lens" in packed
    with torch.no_grad():
        assert sequence_logps(model, packed).tolist() == pytest.approx(sequence_logps(model, padded).tolist(), abs=1e-5)


# --------------------------------------------------------------------------- against TRL


@pytest.fixture
def fresh_accelerate_state():
    """TRL's Trainer sets up Accelerate's process-wide state its own way (cpu=True); put it back afterwards."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


# Chosen answers of one length: TRL's sft term (the micro-batch's mean over chosen tokens) is then llmtrain's (the mean
# over pairs of each one's mean)
EQUAL_PAIRS = [
    {"prompt": "reverse abc =", "chosen": " cba", "rejected": " abc"},
    {"prompt": "reverse hello =", "chosen": " oll", "rejected": " hello"},
    {"prompt": "reverse xy =", "chosen": " yxz", "rejected": " xyy"},
    {"prompt": "reverse stop =", "chosen": " pot", "rejected": " spot"},
]


# TRL's other DPOTrainer loss_types, each under its own name (robust and exo_pair with 10% of labels assumed flipped)
TRL_PAIR_LOSSES = ["hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
                   "discopop", "sigmoid_norm", "aot", "aot_unpaired"]
SETTINGS = {"robust": {"label_smoothing": 0.1}, "exo_pair": {"label_smoothing": 0.1},
            "aot_unpaired": {"label_smoothing": 0.1}}
# f-DPO's divergences (TRL's f_divergence_type, f_alpha_divergence_coef), LD-DPO's ld_alpha and WPO's weights (TRL's
# use_weighting), on losses TRL allows them with: (TRL's loss_type, llmtrain's loss, the knobs by llmtrain's names)
KNOBS = [("sigmoid", "dpo", {"f_divergence": "forward_kl"}), ("hinge", "hinge", {"f_divergence": "js_divergence"}),
         ("sigmoid", "dpo", {"f_divergence": "alpha_divergence"}),
         ("ipo", "ipo", {"f_divergence": "alpha_divergence", "f_alpha": 0.3}),
         ("robust", "robust", {"f_divergence": "forward_kl", "label_smoothing": 0.1}),
         ("sigmoid", "dpo", {"ld_alpha": 0.5}), ("sigmoid", "dpo", {"ld_alpha": 0.0}),
         ("bco_pair", "bco_pair", {"ld_alpha": 0.3}),
         ("sigmoid", "dpo", {"ld_alpha": 0.5, "f_divergence": "js_divergence"}),
         ("sigmoid", "dpo", {"wpo": True}), ("ipo", "ipo", {"wpo": True, "ld_alpha": 0.5}),
         ("apo_zero", "apo_zero", {"wpo": True}),
         # a list of losses, weighted (MPO: TRL's [sigmoid, bco_pair, sft] at [0.8, 0.2, 1], sft_weight here)
         ("sigmoid+bco_pair", ["dpo", "bco_pair"], {"loss_weights": [0.8, 0.2]}),
         ("sigmoid+bco_pair+sft", ["dpo", "bco_pair"], {"loss_weights": [0.8, 0.2]}),
         ("ipo+aot+hinge", ["ipo", "aot", "hinge"], {"loss_weights": [0.5, 1.5, 0.25]})]
TRL_NAMES = {"f_divergence": "f_divergence_type", "f_alpha": "f_alpha_divergence_coef", "wpo": "use_weighting"}
# what TRL 1.16's DPOTrainer logs each step (its num_tokens is llmtrain's tokens_seen)
DPO_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected", "entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy"]


@pytest.mark.parametrize("loss_type, ours, family, knobs", [
    ("sigmoid", "dpo", "llama", {}), ("ipo", "ipo", "llama", {}), ("sigmoid", "dpo", "qwen3_moe", {}),
    ("sigmoid+sft", "dpo", "llama", {}), *((name, name, "llama", SETTINGS.get(name, {})) for name in TRL_PAIR_LOSSES),
    *((theirs, ours, "llama", knobs) for theirs, ours, knobs in KNOBS)])
def test_loss_matches_trl_dpo_trainer(tiny_assets, tiny_tok, tmp_path, loss_type, ours, family, knobs,
                                      fresh_accelerate_state):
    """TRL's DPOTrainer (padded, its own tokenisation and fused LM head) against llmtrain's padding-free pairs, on
    a policy that differs from its reference: the same mean loss to 1e-6. A tiny Qwen3-MoE with the load-balancing
    loss at 0.25 (TRL's router_aux_loss_coef, llmtrain's model.router_aux_loss_coef): TRL adds it to the micro-batch's
    mean loss from its one padded pass over chosen and rejected, llmtrain from its one packed row of them (padding
    left out either way): the same loss, and the gradients of the routers and experts the same to 1e-6. sigmoid+sft:
    TRL's loss_type [sigmoid, sft] weighted 1 and 0.3 against preference.sft_weight 0.3 (RPO), and the same
    gradients. TRL's other loss types (TRL_PAIR_LOSSES) by their names, f-DPO's divergences, LD-DPO's ld_alpha (the
    reference precomputed with the same token weights), WPO's weights and weighted lists of losses (KNOBS): the same
    loss and gradients."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from test_families import family_model
    from transformers import AutoModelForCausalLM

    from llmtrain.model.loss import attach_loss

    coef = 0.25 if family == "qwen3_moe" else None
    folder = tiny_assets / "model" if family == "llama" else family_model(tiny_assets, tmp_path / family, family)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    policy = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    ours_policy, ours_ref = copy.deepcopy(policy), copy.deepcopy(ref)  # before TRL patches its own copies
    sft = 0.3 if loss_type.endswith("+sft") else 0.0
    pairs = EQUAL_PAIRS if sft else PAIRS
    weights = knobs.get("loss_weights", [1.0] * (loss_type.count("+") + 1 - bool(sft)))
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(pairs), report_to="none",
                         beta=0.1, loss_type=loss_type.split("+"), loss_weights=weights + [sft] if sft else weights,
                         max_length=None, use_cpu=True, bf16=False, fp16=False, router_aux_loss_coef=coef,
                         **{TRL_NAMES.get(k, k): v for k, v in knobs.items() if k != "loss_weights"})
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(pairs),
                             processing_class=tiny_tok)
    assert trainer.aux_loss_enabled is (coef is not None)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
    theirs = trainer.compute_loss(trainer.model, inputs)
    with torch.no_grad():
        theirs_ref = torch.stack(trainer.compute_ref_log_probs(trainer.ref_model, inputs), dim=1).flatten()

    cfg = DataConfig(path="x.jsonl", format="preference")
    rows = [encode_pair(p, tiny_tok, cfg) for p in pairs]
    for i, row in enumerate(rows):  # the same tokens as TRL's (prompt, answer + EOS)
        tr = trainer.train_dataset[i]
        assert row["chosen_ids"] == tr["prompt_ids"] + tr["chosen_ids"]
    for m in (ours_policy, ours_ref):
        attach_loss(m, chunk=8, router_aux=coef)
    objective = Preference(PreferenceConfig(loss=ours, beta=0.1, sft_weight=sft, **knobs),
                           pad_id=tiny_tok.pad_token_id, packing=True, reference="precomputed", router_aux=coef)
    with torch.no_grad():
        plain = Preference(objective.cfg, pad_id=objective.pad_id, packing=True, reference="none")
        ref_logps = sequence_logps(ours_ref, plain.collate(rows)[0])
    # the reference's log-probabilities are TRL's (LD-DPO: with the same token weights), and its own are used below:
    # their fp32 rounding over another path (about 1e-6 of log-probabilities near -30) would otherwise be what differs
    assert torch.allclose(ref_logps, theirs_ref, rtol=1e-6, atol=1e-5)
    ref_logps = theirs_ref
    batch, _ = objective.collate([{**r, "ref_chosen": float(a), "ref_rejected": float(b)}
                                  for r, a, b in zip(rows, ref_logps[0::2], ref_logps[1::2])])
    loss, stats = objective.loss(ours_policy, batch)
    assert loss.item() / len(pairs) == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    # and every number TRL's DPOTrainer logs, by its name (the token metrics from the same pass as the loss)
    logged, metrics = objective.step_metrics(stats.tolist(), len(pairs)), trainer._metrics[
        "train" if trainer.model.training else "eval"]
    for name in DPO_METRICS:
        assert logged[name] == pytest.approx(metrics[name][-1], rel=1e-5, abs=1e-6), name
    if knobs.keys() - {"label_smoothing"}:  # and the knob changes the loss (the pairs' answers differ in length)
        plain_cfg = PreferenceConfig(loss=ours, beta=0.1, label_smoothing=knobs.get("label_smoothing", 0.0))
        with torch.no_grad():
            unweighted = Preference(plain_cfg, pad_id=tiny_tok.pad_token_id, packing=True, reference="precomputed")
            ref_plain = sequence_logps(ours_ref, unweighted.reference_free().collate(rows)[0])
            base, _ = unweighted.loss(ours_policy, unweighted.collate([
                {**r, "ref_chosen": float(a), "ref_rejected": float(b)}
                for r, a, b in zip(rows, ref_plain[0::2], ref_plain[1::2])])[0])
        assert abs(base.item() - loss.item()) / len(pairs) > 1e-4
    if (ours in TRL_PAIR_LOSSES or knobs) and not sft:  # and trains what TRL's trains (sft: below)
        theirs.backward()
        (loss / len(pairs)).backward()
        mine = dict(ours_policy.named_parameters())
        biggest = max(p.grad.abs().max().item() for p in trainer.model.parameters())
        assert biggest > 1e-4  # not a zero gradient
        # relative to the largest: sppo_hard's squares of log-ratios minus 5 make gradients of about 20, whose fp32
        # rounding over the padded and the packed paths differs by 1.4e-6 of it (measured); the others within 1e-6
        # but ipo under alpha_divergence at 0.3, whose gradient grows as e^(0.7 u) with each log-ratio u: the two
        # paths' sums of log-probabilities near -30 differ by one fp32 step (3.8e-6, measured), and its gradients
        # by 3.7e-6 of the largest (measured; 1.7e-8 between llmtrain's own packed and padded paths)
        tolerance = 5e-6 if "f_alpha" in knobs else 2e-6
        assert max((mine[n].grad - p.grad).abs().max().item()
                   for n, p in trainer.model.named_parameters()) < tolerance * max(1.0, biggest)
    if sft:  # the term counts (0.3 x the chosen answers' mean NLL per token above DPO's), and trains what TRL's trains
        dpo = Preference(PreferenceConfig(loss=ours, beta=0.1, **knobs), pad_id=tiny_tok.pad_token_id, packing=True,
                         reference="precomputed")
        with torch.no_grad():
            logps = sequence_logps(ours_policy, batch)
            dpo_loss, _ = dpo.loss(ours_policy, batch)
        nll = (-logps[0::2] / batch["sequence_tokens"][0::2]).mean().item()
        assert nll > 1 and (loss.item() - dpo_loss.item()) / len(pairs) == pytest.approx(sft * nll, rel=1e-6)
        theirs.backward()
        (loss / len(pairs)).backward()
        mine = dict(ours_policy.named_parameters())
        assert max((mine[n].grad - p.grad).abs().max().item() for n, p in trainer.model.named_parameters()) < 1e-6
    if coef is not None:  # the load-balancing loss counts, and trains what TRL's trains
        assert objective.step_metrics(stats.tolist(), len(PAIRS))["aux_loss"] == pytest.approx(
            trainer._metrics["train" if trainer.model.training else "eval"]["aux_loss"][-1], rel=1e-6)
        theirs.backward()
        (loss / len(PAIRS)).backward()
        mine = dict(ours_policy.named_parameters())
        moe = [(n, p) for n, p in trainer.model.named_parameters() if ".mlp." in n]
        assert moe and all((mine[n].grad - p.grad).abs().max() < 1e-6 for n, p in moe)


def test_token_metrics_are_means_over_each_answers_tokens_not_over_pairs():
    """TRL's DPOTrainer token metrics from loss.PAIR_STATS' columns (entropy, log sum of squares, mean logit, argmax
    hit): entropy over every answer token, logits/chosen and mean_token_accuracy over the chosen answers' tokens
    (sequences 0, 2: 5 tokens, 3 of them the argmax), logits/rejected over the rejected ones' (sequences 1, 3);
    weighted by tokens, not averaged per pair. And the per-token columns are the entropy and log sum of squares of
    the softmax, the logits' mean, the argmax's hit."""
    from llmtrain.model.loss import _pair_stats
    from llmtrain.objectives.preference import pair_metrics, stat_names, token_sums

    sequence = torch.tensor([0, 0, 0, 0, 1, 2, 3, 3])  # pair 1: 4 chosen, 1 rejected; pair 2: 1 chosen, 2 rejected
    per_token = torch.tensor([[1.0, 0, 0.5, 1], [2.0, 0, 0.1, 0], [1.0, 0, -0.3, 1], [0.5, 0, 0.2, 0],
                              [3.0, 0, 1.0, 1], [1.5, 0, 0.4, 1], [0.5, 0, -1.0, 1], [0.0, 0, 0.0, 0]])
    sums = token_sums(per_token, sequence)
    names = stat_names(PreferenceConfig())
    stats = [0.0] * (len(names) - 6) + sums.tolist() + [5.0, 3.0]  # the chosen and rejected tokens
    logged = pair_metrics(names, stats, 2)
    assert logged["entropy"] == pytest.approx(9.5 / 8)
    assert logged["logits/chosen"] == pytest.approx(0.9 / 5) and logged["logits/rejected"] == pytest.approx(0.0)
    assert logged["mean_token_accuracy"] == pytest.approx(3 / 5)
    assert "tokens/chosen" not in logged
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0)) * 3
    targets = torch.tensor([int(logits[0].argmax()), 0, 1, 2, int(logits[4].argmax()), 3])
    columns = _pair_stats(logits, targets)
    p = logits.softmax(-1)
    assert torch.allclose(columns[:, 0], -(p * p.log()).sum(-1), atol=1e-5)
    assert torch.allclose(columns[:, 1], (p * p).sum(-1).log(), atol=1e-5)
    assert torch.allclose(columns[:, 2], logits.mean(-1))
    assert columns[:, 3].tolist() == (logits.argmax(-1) == targets).float().tolist() and columns[[0, 4], 3].sum() == 2


# Pairs with an empty prompt (TRL's ORPO gives them BOS alone, as llmtrain does) and chosen answers of one length: TRL's
# NLL term, a micro-batch mean over every token of the chosen rows after the first, prompt included, is then llmtrain's,
# the mean over pairs of each chosen answer's mean NLL per token (the paper's term and LLaMA-Factory's)
PROMPTLESS = [
    {"prompt": "", "chosen": "cba", "rejected": "abc"},
    {"prompt": "", "chosen": "oll", "rejected": "hello"},
    {"prompt": "", "chosen": "yxz", "rejected": "xyy"},
    {"prompt": "", "chosen": "pot", "rejected": "spot"},
]


def _perturbed_pair(tiny_assets):
    """The tiny model with every weight perturbed (0.02 noise, seed 0): as TRL's trainer gets it, and a copy with
    llmtrain's chunked loss attached."""
    from transformers import AutoModelForCausalLM

    from llmtrain.model.loss import attach_loss

    policy = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32,
                                                  attn_implementation="eager")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    ours = copy.deepcopy(policy)
    attach_loss(ours, chunk=8)
    return policy, ours


def _both_losses(trainer, objective, ours, pairs, tokenizer, cfg):
    """TRL's trainer's loss and metrics on `pairs` (one padded batch) and llmtrain's objective's on the same pairs
    encoded by llmtrain, which are first checked to be TRL's tokens and trained labels: (theirs, their metrics,
    our batch, our loss sum, our statistics), our gradients zeroed before."""
    rows = [encode_pair(p, tokenizer, cfg) for p in pairs]
    for i, row in enumerate(rows):  # the same tokens and trained labels as TRL's
        tr = trainer.train_dataset[i]
        assert (row["chosen_ids"], row["chosen_labels"]) == (tr["chosen_input_ids"], tr["chosen_labels"])
    theirs, metrics = trainer.get_batch_loss_metrics(trainer.model, trainer.data_collator(
        [trainer.train_dataset[i] for i in range(len(pairs))]))
    batch, _ = objective.collate(rows)
    ours.zero_grad()
    return (theirs, metrics, batch, *objective.loss(ours, batch))


def test_orpo_matches_trl_orpo_trainer(tiny_assets, tiny_tok, tmp_path, fresh_accelerate_state):
    """TRL's ORPOTrainer (trl.experimental.orpo, padded, its own tokenisation) against llmtrain's padding-free pairs
    with preference.loss=orpo, on a perturbed tiny model. Where TRL's NLL term is the paper's (PROMPTLESS): the same
    mean loss and every parameter's gradient to 1e-6. With prompts of their own and answers of unequal lengths (PAIRS):
    the odds-ratio term (TRL's logged log_odds_ratio), the rewards and the accuracy are the same; the NLL terms differ
    only as TRL counts the prompt's tokens too."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    policy, ours = _perturbed_pair(tiny_assets)
    cfg = DataConfig(path="x.jsonl", format="preference")
    objective = Preference(PreferenceConfig(loss="orpo", beta=0.1), pad_id=tiny_tok.pad_token_id, packing=True,
                           reference="none")
    args = ORPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to="none", beta=0.1,
                      max_length=64, use_cpu=True, bf16=False, fp16=False)
    for pairs in (PROMPTLESS, PAIRS):
        trainer = ORPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=Dataset.from_list(pairs),
                              processing_class=tiny_tok)
        theirs, metrics, batch, loss, stats = _both_losses(trainer, objective, ours, pairs, tiny_tok, cfg)
        with torch.no_grad():
            logps = sequence_logps(ours, batch)
        nll = (-logps[0::2] / batch["sequence_tokens"][0::2]).mean().item()
        n = len(pairs)
        odds_term = (loss.item() / n - nll) / -0.1  # the mean log sigmoid of the log odds ratio
        assert odds_term == pytest.approx(metrics["log_odds_ratio"], rel=1e-5, abs=1e-6)
        logged = objective.step_metrics(stats.tolist(), n)  # and llmtrain logs TRL's ORPO metrics by their names
        for name in ("log_odds_ratio", "log_odds_chosen", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert logged[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-6), name
        assert logged["nll_loss"] == pytest.approx(nll, rel=1e-6)
        assert stats[0].item() / n == pytest.approx(metrics["rewards/chosen"], rel=1e-5)
        assert stats[2].item() / n == metrics["rewards/accuracies"]
        if pairs is PROMPTLESS:
            assert metrics["nll_loss"] == pytest.approx(nll, rel=1e-6)
            assert loss.item() / n == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
            theirs.backward()
            (loss / n).backward()
            mine = dict(ours.named_parameters())
            assert max((mine[k].grad - p.grad).abs().max().item() for k, p in trainer.model.named_parameters()) < 1e-6
        else:  # TRL's NLL counts the prompts' tokens too: higher here, where the prompts are harder to predict
            assert metrics["nll_loss"] != pytest.approx(nll, rel=1e-3)


def test_simpo_matches_trl_cpo_trainer(tiny_assets, tiny_tok, tmp_path, fresh_accelerate_state):
    """TRL's SimPO is its CPOTrainer with loss_type=simpo and cpo_alpha=0 (trl.experimental.cpo, padded, its own
    tokenisation): on pairs with prompts and answers of unequal lengths, the same mean loss, rewards, margins and
    accuracy, and the logps/ it logs, which are per answer token (average_log_prob) as its rewards are: llmtrain had
    logged summed log-probs beside rewards of beta times the per-token mean. And every parameter's gradient to 1e-6."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    policy, ours = _perturbed_pair(tiny_assets)
    cfg = DataConfig(path="x.jsonl", format="preference")
    objective = Preference(PreferenceConfig(loss="simpo", beta=2.0, simpo_gamma=0.5), pad_id=tiny_tok.pad_token_id,
                           packing=True, reference="none")
    args = CPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, report_to="none", beta=2.0,
                     loss_type="simpo", simpo_gamma=0.5, cpo_alpha=0.0, max_length=64, use_cpu=True, bf16=False,
                     fp16=False)
    trainer = CPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=Dataset.from_list(PAIRS),
                         processing_class=tiny_tok)
    theirs, metrics, _, loss, stats = _both_losses(trainer, objective, ours, PAIRS, tiny_tok, cfg)
    n = len(PAIRS)
    assert loss.item() / n == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    logged = objective.step_metrics(stats.tolist(), n)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected"):
        assert logged[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-6), name
    assert logged["rewards/chosen"] == pytest.approx(2.0 * logged["logps/chosen"], rel=1e-6)
    theirs.backward()
    (loss / n).backward()
    mine = dict(ours.named_parameters())
    assert max((mine[k].grad - p.grad).abs().max().item() for k, p in trainer.model.named_parameters()) < 1e-6


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("loss", ["dpo", "dpo+sft", "orpo"])
def test_packed_and_padded_runs_and_accumulation_agree(pref_recipe, tmp_path, loss):
    """Full fine-tune, precomputed reference: varlen packed rows against eager padded rows, and micro-batch 8 against
    4 x accumulation 2: the same losses, and the same weights for the accumulation pair; with preference.sft_weight
    too (its term a mean over pairs, not over a micro-batch's tokens), and for ORPO (no reference pass at all)."""
    kind, _, sft = loss.partition("+")
    terms = [f"preference.loss={kind}", f"preference.sft_weight={0.5 if sft else 0}"]
    summary = run_train(pref_recipe, f"output_dir={tmp_path / 'padded'}", *terms)
    run_train(pref_recipe, f"output_dir={tmp_path / 'packed'}", "model.attn_implementation=auto", *terms)
    run_train(pref_recipe, f"output_dir={tmp_path / 'accum'}", "train.micro_batch_size=4", "train.grad_accum_steps=2",
              *terms)
    padded, packed, accum = (records(tmp_path / n) for n in ("padded", "packed", "accum"))
    assert [r["loss"] for r in packed] == pytest.approx([r["loss"] for r in padded], abs=1e-5)
    assert [r["loss"] for r in accum] == pytest.approx([r["loss"] for r in padded], abs=1e-5)
    assert [r["rewards/margins"] for r in accum] == pytest.approx([r["rewards/margins"] for r in padded], abs=1e-5)
    assert [r["grad_norm"] for r in accum] == pytest.approx([r["grad_norm"] for r in padded], rel=1e-5)
    # Adam scales each element by its own gradient history, so rounding in near-zero gradients moves some weights
    # by a visible fraction of lr=1e-3 (7e-5 measured); the losses and gradient norms above are the tight checks.
    assert max_abs_diff(load_weights(tmp_path / "accum" / "final"), load_weights(tmp_path / "padded" / "final")) < 2e-4
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen"} <= padded[0].keys()
    assert (summary["setup_time_s"] == 0) is (kind == "orpo")  # the time of the reference pass
    if kind == "orpo":  # no reference pass; the loss falls as SFT's would (its NLL term)
        assert padded[-1]["loss"] < padded[0]["loss"] - 0.5
        assert padded[-1]["logps/chosen"] > padded[0]["logps/chosen"]
        return
    # the first step's policy is the reference: DPO's loss ln 2 (the sft term on top: its value by hand and against
    # TRL's above), its rewards 0
    assert padded[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    if sft:
        assert padded[0]["loss"] > math.log(2) + 0.1
    else:
        assert padded[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_the_reference_caches_key_changes_with_what_changes_the_references_numbers(pref_recipe):
    """The precomputed reference's cache is named by loop/phases.model_key: a recipe that changes the reference model's
    outputs gets another cache (the same recipe the same one). model.random_init and model.rope_scaling had the
    recipe's key, so a DPO run after a random_init check of its recipe read the random model's log-probabilities."""
    from llmtrain.config import load_recipe
    from llmtrain.loop.phases import model_key

    same = model_key(load_recipe(pref_recipe, []))
    assert model_key(load_recipe(pref_recipe, [])) == same
    changed = {o: model_key(load_recipe(pref_recipe, [o])) for o in (
        "model.random_init=true", "model.rope_scaling={rope_type: linear, factor: 2}", "model.new_tokens=[<x>]",
        "model.kernels=none", "model.dtype=bfloat16", "preference.ld_alpha=0.5")}
    assert same not in changed.values() and len(set(changed.values())) == len(changed), changed
    seeded = model_key(load_recipe(pref_recipe, ["model.random_init=true", "train.seed=8"]))
    assert seeded != changed["model.random_init=true"]  # random weights of another seed


def test_resume_finds_the_reference_again_and_ends_as_the_uninterrupted_run(pref_recipe, tmp_path, monkeypatch):
    common = ["train.max_steps=6", "checkpoint.every_steps=3"]
    run_train(pref_recipe, f"output_dir={tmp_path / 'straight'}", *common)
    # (the newest: the session's data cache holds other tests' reference files too)
    cache = sorted((tmp_path.parent).rglob("reference-train-*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    assert cache
    # Only the pairs that 6 steps of 8 train on are computed (of the 355), not the whole epoch's, and it is said.
    assert int((~torch.load(cache[0])[:, 0].isnan()).sum()) == 6 * 8
    assert "reference log-probabilities of the 48 train pairs the run uses (of 355)" in \
        (tmp_path / "straight" / "train.log").read_text()
    written = {p: p.stat().st_mtime_ns for p in cache}
    crash_at_step(monkeypatch, pref_recipe, 5, f"output_dir={tmp_path / 'cut'}", *common)
    run_train(pref_recipe, f"output_dir={tmp_path / 'cut'}", *common, resume="auto")
    assert {p: p.stat().st_mtime_ns for p in cache} == written  # read, never recomputed
    assert [r["loss"] for r in records(tmp_path / "cut")] == [r["loss"] for r in records(tmp_path / "straight")]
    assert max_abs_diff(load_weights(tmp_path / "cut" / "final"), load_weights(tmp_path / "straight" / "final")) == 0


def test_a_stop_during_the_reference_pass_keeps_what_it_computed(pref_recipe, tmp_path, monkeypatch):
    """Audit 54: a SIGTERM during the reference pass (minutes on a 7B model's dataset) kept nothing, though the
    docs promise a resume computes only what is missing. It now ends the pass after a batch, caches the pairs done,
    and exits 143 saying so; the same command computes the rest and trains as a run never stopped."""
    import llmtrain.objectives.preference as preference
    from llmtrain.errors import Stopped

    common = ["data.eval_split=null", "train.eval_batch_size=8"]
    straight = run_train(pref_recipe, f"output_dir={tmp_path / 'straight'}", f"data.cache_dir={tmp_path / 'c1'}",
                         *common)
    (whole,) = (tmp_path / "c1").rglob("reference-train-*.pt")
    real = preference.precompute_reference

    def stopped_after_two_batches(*args, on_batch, **kwargs):
        def signalled(done, total):
            on_batch(done, total)
            if done == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, on_batch=signalled, **kwargs)

    cut = [f"output_dir={tmp_path / 'cut'}", f"data.cache_dir={tmp_path / 'c2'}", *common]
    monkeypatch.setattr(preference, "precompute_reference", stopped_after_two_batches)
    with pytest.raises(Stopped, match="SIGTERM during the reference log-probabilities: the 16 pairs computed of "
                                      "the 48 left are kept in") as stop:
        run_train(pref_recipe, *cut)
    assert stop.value.exit_code == 143
    (part,) = (tmp_path / "c2").rglob("reference-train-*.pt")
    kept, full = torch.load(part), torch.load(whole)
    assert int((~kept[:, 0].isnan()).sum()) == 16
    assert torch.equal(kept[~kept[:, 0].isnan()], full[~kept[:, 0].isnan()])
    monkeypatch.setattr(preference, "precompute_reference", real)
    done = run_train(pref_recipe, *cut)
    assert torch.equal(torch.load(part).nan_to_num(), full.nan_to_num())
    assert done["final_loss"] == straight["final_loss"]
    assert max_abs_diff(load_weights(tmp_path / "cut" / "final"), load_weights(tmp_path / "straight" / "final")) == 0


@pytest.mark.extended  # main tier: a quality check on real data; exactness: the TRL comparisons
@pytest.mark.slow  # a longer run: make test, not the fast tier
@needs(GSM8K)
def test_held_out_reward_accuracy_rises_on_gsm8k_pairs(tiny_assets, tmp_path):
    """Chosen: GSM8K's real final answer; rejected: the same number with a digit appended. LoRA, the reference is
    the disabled adapter; the held-out pairs' reward accuracy starts at 0 (policy = reference) and rises."""
    from helpers import write_recipe

    rows = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:1500]]
    pairs = []
    for r in rows:
        final = r["answer"].rsplit("####", 1)[1].strip()
        if len(r["question"]) <= 160 and final.isdigit():
            pairs.append({"prompt": r["question"], "chosen": f"#### {final}", "rejected": f"#### {final}0"})
    train = write_jsonl(tmp_path / "train.jsonl", pairs[:240])
    held = write_jsonl(tmp_path / "held.jsonl", pairs[240:300])
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(train), "format": "preference", "max_seq_len": 256,
                                                       "chat_template": True, "eval_split": str(held)},
                          preference={"loss": "dpo", "beta": 0.1}, lora={"r": 8, "alpha": 16, "dropout": 0.0},
                          model={"attn_implementation": "auto"},
                          train={"max_steps": 15, "micro_batch_size": 16, "lr": 1e-2, "warmup_steps": 0,
                                 "eval_every_steps": 15, "eval_batch_size": 32})
    run_train(recipe)
    first = records(tmp_path / "run")[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["rewards/accuracies"] == 0
    (last_eval,) = records(tmp_path / "run", "eval")
    assert last_eval["eval_rewards/accuracies"] > 0.9 and last_eval["eval_rewards/margins"] > 0


@pytest.mark.slow
# cpu_ddp: extended (main tier: FSDP's and TP's, and DDP's own equality in test_ddp.py)
@pytest.mark.parametrize("launch, lora", [pytest.param("cpu_ddp", False, marks=pytest.mark.extended),
                                          ("cpu_fsdp", False),
                                          pytest.param("cpu_fsdp", True, marks=pytest.mark.extended),
                                          # extended: tensor parallelism's own test_tp.py, and the reward
                                          # model's tp cell (test_capabilities.py) run in the main tier
                                          pytest.param("cpu_tp", False, marks=pytest.mark.extended)])
def test_two_processes_train_the_pairs_of_one(one_process, tmp_path, free_port, launch, lora):
    """2 CPU data ranks (gloo, through accelerate launch; DDP, FSDP2 sharding every parameter, or FSDP x TP: 4
    processes as 2 shards x 2 tensor-parallel) x micro-batch 4 against 1 process x 8: the same pairs per step, the
    same losses and rewards. Full fine-tune: the reference is precomputed once, shared over all ranks (under TP each
    pair's by one TP group); LoRA under FSDP2: the disabled adapter of the sharded model."""
    import subprocess
    import sys

    from helpers import ENV, REPO

    extra = LORA_OVERRIDES if lora else []
    pref_recipe, one_run = one_process(lora)
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
         str(REPO / "accelerate_configs" / f"{launch}.yaml"), "--main_process_port", str(free_port),
         "-m", "llmtrain", "finetune", str(pref_recipe), f"output_dir={tmp_path / 'two'}", "train.micro_batch_size=4",
         *extra],
        env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = records(one_run), records(tmp_path / "two")
    # How far two fp32 computations of the same sums may drift when their reductions run in another order (a
    # process's share of the batch, FSDP's gathered layers, DTensor's split matmuls and all-reduces): a summed
    # log-probability is a sum over the answer's tokens of values that each went through the layers' dot products
    # of `hidden` terms; rounding errors of such sums grow as eps x sqrt(terms), with a factor 4 of margin (a
    # bound from one machine's measurement broke on the next: 2.76e-6 under TP against 2e-6).
    hidden, layers, tokens = 128, 2, 32  # the tiny Llama's width and depth, and data.max_seq_len
    rel = 4 * 2.0**-24 * math.sqrt(hidden * layers * tokens)  # 1.5e-5
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        # Step 1's policy is the reference: one process gives every margin exactly 0, TP +-5e-8 (measured: under
        # DTensor the no-grad reference pass and the training forward are not bitwise equal), and accuracy counts
        # margin > 0. Step 1's margins and losses are still compared.
        skip = 1 if (launch == "cpu_tp" and key == "rewards/accuracies") else 0
        assert [r[key] for r in two][skip:] == pytest.approx([r[key] for r in one][skip:], rel=rel, abs=1e-5), key
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    if lora:
        assert one[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    else:
        assert max_abs_diff(load_weights(tmp_path / "two" / "final"), load_weights(one_run / "final")) < 2e-4


def test_token_budgets_bin_whole_pairs_and_samples_show_the_chosen_answer(pref_recipe, tmp_path):
    """train.micro_batch_tokens packs whole pairs (a pair's length is its two sequences); eval_samples generate from
    the held-out prompts beside the chosen answer; doctor passes the recipe with the same data checks."""
    from llmtrain.config import load_recipe
    from llmtrain.doctor import run_doctor

    summary = run_train(pref_recipe, "train.micro_batch_size=1", "train.micro_batch_tokens=96",
                        "model.attn_implementation=auto", "train.eval_samples=2", "train.eval_max_new_tokens=4")
    lines = records(tmp_path / "run")
    assert all(r["tokens"] <= 96 for r in lines) and 0 < summary["packing_efficiency"] <= 1
    assert lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["prompt"].startswith("<s>reverse") or "reverse" in s["prompt"] for s in samples)
    assert all(s["expected"].strip() and s["expected"].strip() != s["prompt"].split()[-2] for s in samples)
    rows = {name: status for name, status, _ in run_doctor(load_recipe(pref_recipe), gpu_memory=80)}
    assert rows["loss mask"] == "pass" and rows["eos trained"] == "pass" and "fail" not in rows.values()


@pytest.mark.slow
def test_an_idle_rank_under_fsdp_runs_the_reference_forward_too(tiny_assets, tmp_path, free_port):
    """LoRA DPO under FSDP2 on 9 pairs, 2 processes x 4: step 2 has one pair, so process 1 idles. A working rank runs
    two forwards (the reference's, adapter off, then the policy's), each gathering every layer from every rank, so the
    idle rank's stand-in (weight 0, the normal path) must run both (without it: gloo's "Received data size doesn't match expected size" at
    step 2, a hang on NCCL). Both steps equal one process's with micro-batches of 8."""
    from helpers import launch_finetune, write_recipe

    data = write_jsonl(tmp_path / "pairs.jsonl", reversal_pairs(tiny_assets, 9))
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data), "format": "preference", "max_seq_len": 32},
                          preference={"loss": "dpo", "beta": 0.1}, lora={"r": 4, "alpha": 8, "dropout": 0.0},
                          train={"max_steps": 2, "micro_batch_size": 8, "lr": 1e-2, "warmup_steps": 0, "seed": 7})
    run_train(recipe, f"output_dir={tmp_path / 'one'}")
    launch_finetune(REPO / "accelerate_configs" / "cpu_fsdp.yaml", 2, free_port, recipe,
                    f"output_dir={tmp_path / 'two'}", "train.micro_batch_size=4")
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one] and len(one) == 2
    assert one[1]["rewards/margins"] != 0  # step 2 is not the reference: the adapter moved at step 1
    for key in ("loss", "rewards/margins", "logps/chosen"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5, abs=1e-5), key


@pytest.mark.slow
def test_under_fsdp_the_reference_of_a_random_start_is_the_policys_own_shards(tiny_assets, tmp_path, free_port):
    """A full fine-tune's DPO with preference.reference=copy from model.random_init under FSDP2 (2 processes): the
    reference is copied from the policy's shards (reference.copy_into), so there is a start to copy where the table
    refused it (the reference had been the starting weights read again from model.name_or_path, and a random start
    has none). Its first step's loss is ln 2 (the reference is the policy, to the bit: a reference of other random
    weights gives another loss), and both steps equal one process's, whose reference is copy.deepcopy of the policy;
    the log says where the reference came from."""
    from helpers import launch_finetune, write_recipe

    data = write_jsonl(tmp_path / "pairs.jsonl", reversal_pairs(tiny_assets, 8))
    recipe = write_recipe(tiny_assets, tmp_path, data={"path": str(data), "format": "preference", "max_seq_len": 32},
                          model={"random_init": True}, preference={"loss": "dpo", "beta": 0.1, "reference": "copy"},
                          train={"max_steps": 2, "micro_batch_size": 8, "lr": 1e-3, "warmup_steps": 0, "seed": 7})
    run_train(recipe, f"output_dir={tmp_path / 'one'}")
    out = launch_finetune(REPO / "accelerate_configs" / "cpu_fsdp.yaml", 2, free_port, recipe,
                          f"output_dir={tmp_path / 'two'}", "train.micro_batch_size=4")
    assert "reference: the starting weights, sharded like the policy (copied from its shards)" in out
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert two[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and len(two) == 2
    assert two[1]["rewards/margins"] != 0  # step 2's policy is not the reference
    for key in ("loss", "rewards/margins", "logps/chosen"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5, abs=1e-5), key


@pytest.mark.extended  # main tier: a quality check of the demo recipe; DPO's exactness: the TRL comparisons above
@pytest.mark.slow
def test_the_tiny_dpo_recipe_ranks_held_out_reversals_above_their_near_misses(tiny_assets, tmp_path):
    """recipes/tiny-dpo.yaml as `make demo-dpo` runs it, on this session's tiny assets: the short SFT run, then DPO
    (a full fine-tune on prepare-tiny's pairs): the held-out pairs' reward accuracy climbs to about 0.99 and the
    margin opens, the rejected near misses losing log-probability while the chosen reversals keep theirs."""
    sft, data = tmp_path / "sft", tiny_assets / "data"
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    run_train(REPO / "recipes" / "tiny.yaml", f"model.name_or_path={tiny_assets / 'model'}",
              f"data.path={data / 'train.jsonl'}", f"data.eval_split={data / 'eval.jsonl'}", cache,
              "train.max_steps=150", f"output_dir={sft}")
    run_train(REPO / "recipes" / "tiny-dpo.yaml", f"model.name_or_path={sft / 'final'}",
              f"data.path={data / 'train_pairs.jsonl'}", f"data.eval_split={data / 'eval_pairs.jsonl'}", cache,
              f"output_dir={tmp_path / 'dpo'}")
    evals = records(tmp_path / "dpo", "eval")
    assert [e["step"] for e in evals] == [100, 200, 300, 400, 500]
    accuracy = [e["eval_rewards/accuracies"] for e in evals]  # 0.87, 0.895, 0.955, 0.96, 0.99 measured
    assert accuracy[-1] >= 0.97 and accuracy[-1] > accuracy[0] + 0.05
    assert evals[-1]["eval_rewards/margins"] > 0.6 > 0.3 > evals[0]["eval_rewards/margins"]  # 0.83, 0.19 measured
    assert evals[-1]["eval_logps/rejected"] < evals[0]["eval_logps/rejected"] - 4  # -21.77 from -15.64
    assert evals[-1]["eval_logps/chosen"] > evals[0]["eval_logps/chosen"] - 1  # -8.69 from -8.94
