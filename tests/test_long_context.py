"""Long context on one GPU: model.activation_offload (checkpointed layer inputs in host memory) and model.tiled_mlp
(the MLP over shards of the tokens, recomputed shard by shard in backward).

Each is exact against the model without it, on a 4-layer tiny Llama in fp32 trained 3 steps: offload bit for bit,
tiling to 1e-6 (the shards sum floats in another order) for the loss and every trainable gradient, full fine-tune,
LoRA and QLoRA, on rows of packed documents whose length is no multiple of the shard. Then the real training entry,
and a preempted run resumed with both on.
"""

from __future__ import annotations

import pytest
import torch
from helpers import crash_at_step, losses, records, run_train, write_recipe

from llmtrain.config import LoraConfig, ModelConfig, load_recipe
from llmtrain.errors import RecipeError
from llmtrain.model.loss import causal_lm
from llmtrain.model.modeling import load_model

LAYERS = 4
SHARD = 5
# Two rows of 37 tokens (74, not a multiple of SHARD): the first packs three documents, positions restarting.
POSITIONS = torch.tensor([list(range(12)) + list(range(15)) + list(range(10)), list(range(37))])
LORA = LoraConfig(r=4, alpha=8.0, dropout=0.0)


pytestmark = pytest.mark.long(80)  # tests/conftest.py


@pytest.fixture(scope="module")
def four_layers(tiny_assets, tmp_path_factory):
    """The tiny Llama with 4 decoder layers (random weights), so that 'once per layer' means something."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_assets / "model")
    config.num_hidden_layers = LAYERS
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("four_layers")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def build(path, lora=None, **model):
    torch.manual_seed(1)  # the LoRA adapters' init
    cfg = ModelConfig(name_or_path=str(path), dtype="float32", attn_implementation="eager", **model)
    return load_model(cfg, lora).train()


def train_steps(model, steps: int = 3, mutate_saved=None):
    """`steps` SGD steps on fixed batches; the loss and the trainable gradients of each step. (SGD: AdamW would
    turn a 1e-9 difference in a near-zero gradient into a step of lr.)"""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    vocab = model.config.vocab_size
    out = []
    for step in range(steps):
        ids = torch.randint(0, vocab, POSITIONS.shape, generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, position_ids=POSITIONS, labels=ids).loss
        if mutate_saved is not None:
            mutate_saved(model)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        optimizer.step()
        optimizer.zero_grad()
    return out


def assert_same(a, b, *, exact: bool):
    for (loss_a, grads_a), (loss_b, grads_b) in zip(a, b, strict=True):
        assert grads_a.keys() == grads_b.keys() and grads_a
        if exact:
            assert torch.equal(loss_a, loss_b)
            assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
        else:
            assert loss_a.item() == pytest.approx(loss_b.item(), abs=1e-6)
            worst = max((grads_a[k] - grads_b[k]).abs().max().item() for k in grads_a)
            assert worst < 1e-6, worst


# --------------------------------------------------------------------------- activation_offload


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_offload_is_bit_identical_and_packs_once_per_layer_but_the_last(four_layers, lora):
    plain = train_steps(build(four_layers, lora, gradient_checkpointing=True))
    model = build(four_layers, lora, gradient_checkpointing=True, activation_offload=True)
    offloaded = train_steps(model)
    assert_same(offloaded, plain, exact=True)
    stats = causal_lm(model).activation_offload.stats
    # Every step, each layer but the last sent its input (2 x 37 tokens x 128 fp32) to the host and read it back.
    assert stats["packed"] == stats["unpacked"] == 3 * (LAYERS - 1)
    assert stats["kept"] == 3
    assert stats["prefetched"] == 3 * (LAYERS - 2)
    assert stats["bytes"] == 3 * (LAYERS - 1) * 74 * 128 * 4


def test_the_backward_recomputes_from_the_host_copy(four_layers):
    """Zeroing the host copies between forward and backward changes the gradients: the backward reads them, not the
    layer inputs still referenced elsewhere."""
    def zero_host_copies(model):
        queue = causal_lm(model).activation_offload._queue
        assert len(queue) == LAYERS - 1
        for ref in queue:
            ref().host.zero_()

    model = build(four_layers, gradient_checkpointing=True, activation_offload=True)
    reference = train_steps(build(four_layers, gradient_checkpointing=True), steps=1)
    spoiled = train_steps(model, steps=1, mutate_saved=zero_host_copies)
    assert torch.equal(spoiled[0][0], reference[0][0])  # the forward is untouched
    assert not torch.equal(spoiled[0][1]["model.layers.0.mlp.up_proj.weight"],
                           reference[0][1]["model.layers.0.mlp.up_proj.weight"])


def test_offload_without_checkpointing_is_refused(tiny_assets, tmp_path):
    recipe = write_recipe(tiny_assets, tmp_path)
    with pytest.raises(RecipeError, match="Set model.gradient_checkpointing=true"):
        load_recipe(recipe, ["model.activation_offload=true"])
    with pytest.raises(RecipeError, match="at least 2"):
        load_recipe(recipe, ["model.tiled_mlp=0"])
    assert load_recipe(recipe, ["model.tiled_mlp=true"]).model.tiled_mlp is True
    assert load_recipe(recipe, ["model.tiled_mlp=4096", "data.max_seq_len=8192"]).model.tiled_mlp == 4096
    # a micro-batch of rows is tiled as one: 16 rows of 64 tokens take shards of 100 (had been refused as longer
    # than a row, audit 3)
    assert load_recipe(recipe, ["model.tiled_mlp=100", "data.max_seq_len=64", "train.micro_batch_size=16"]
                       ).model.tiled_mlp == 100


@pytest.mark.parametrize("overrides, says", [
    (["model.tiled_mlp=1"], "1 is read as the tokens of one shard of the MLP .* not as 'on'. Write true"),
    (["model.tiled_mlp=100000", "train.micro_batch_size=2"],
     r"model.tiled_mlp=100000 tokens a shard, but a micro-batch holds at most 4,096 tokens "
     r"\(train.micro_batch_size=2 x data.max_seq_len=2048\): .* nothing would be tiled"),
    (["model.tiled_mlp=64", "train.micro_batch_size=1", "train.micro_batch_tokens=128", "parallel.sequence_parallel=2"],
     r"a process holds at most 64 tokens of a micro-batch \(train.micro_batch_tokens=128, sequence_parallel=2\)"),
])
def test_a_shard_of_one_token_or_longer_than_the_rows_is_refused(tiny_assets, tmp_path, overrides, says):
    """Values that would be accepted and do the opposite of what they say (issue 53, item 4): 1 read as a one-token
    shard where a user meant 'on'; a shard no row reaches, which tiles nothing."""
    recipe = write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 2048})
    with pytest.raises(RecipeError, match=says):
        load_recipe(recipe, overrides)


def test_true_whose_hidden_size_no_micro_batch_reaches_is_refused_once_the_model_is_read(tiny_assets, tmp_path):
    """model.tiled_mlp: true takes shards of hidden_size tokens (the tiny model's 128): a micro-batch of 64 tokens
    tiled nothing, and the run said "MLP tiled in shards of 128 tokens"; the same shard written as 128 was refused,
    advising true."""
    from transformers import AutoConfig

    from llmtrain import capabilities
    from llmtrain.layout import Layout

    config = AutoConfig.from_pretrained(tiny_assets / "model")
    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 64}),
                         ["model.tiled_mlp=true", "train.micro_batch_size=1"])
    [problem] = capabilities.problems(recipe, Layout(processes=1), model=config)
    assert problem.startswith("model.tiled_mlp: true tiles in shards of the model's hidden_size, 128 tokens, but a "
                              "micro-batch holds at most 64 tokens (train.micro_batch_size=1 x data.max_seq_len=64)")
    assert "model.tiled_mlp=16" in problem  # a shard that tiles, not true
    reaches = load_recipe(write_recipe(tiny_assets, tmp_path, data={"max_seq_len": 64}),
                          ["model.tiled_mlp=true", "train.micro_batch_size=4"])  # 256 tokens: shards of 128 tile
    assert capabilities.problems(reaches, Layout(processes=1), model=config) == []


# --------------------------------------------------------------------------- tiled_mlp

QLORA = dict(quantize="nf4")


@pytest.mark.parametrize("method", ["full", "lora", pytest.param("qlora", marks=pytest.mark.precision)])
def test_tiled_mlp_equals_the_untiled_one(four_layers, method):
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    lora, extra = (None, {}) if method == "full" else (LORA, QLORA if method == "qlora" else {})
    untiled = train_steps(build(four_layers, lora, **extra))
    tiled = train_steps(build(four_layers, lora, tiled_mlp=SHARD, **extra))
    assert_same(tiled, untiled, exact=False)
    if lora is not None:  # the adapters on gate/up/down got their gradients through the tiled backward
        assert any("mlp.down_proj.lora_B" in k and v.abs().sum() > 0 for k, v in tiled[-1][1].items())


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_tiled_mlp_with_offload_and_checkpointing_equals_the_plain_model(four_layers, lora):
    plain = train_steps(build(four_layers, lora))
    both = train_steps(build(four_layers, lora, gradient_checkpointing=True, activation_offload=True, tiled_mlp=SHARD))
    assert_same(both, plain, exact=False)


def test_tiled_mlp_keeps_one_shard_of_intermediates(four_layers):
    """The bytes the forward saves for backward: tiled, the (tokens x intermediate) tensors of gate, up, silu and
    their product are gone (4 of them a layer), only the MLP's input is kept (already saved for gate/up)."""
    def saved_bytes(model) -> int:
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size() if not isinstance(t, torch.nn.Parameter) else 0
            return t

        ids = torch.zeros(POSITIONS.shape, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, position_ids=POSITIONS, labels=ids)
        return total[0]

    untiled, tiled = saved_bytes(build(four_layers)), saved_bytes(build(four_layers, tiled_mlp=SHARD))
    intermediate = build(four_layers).config.intermediate_size
    assert untiled - tiled >= LAYERS * 4 * 74 * intermediate * 4


def test_tiled_mlp_replays_lora_dropout(four_layers, monkeypatch):
    """With dropout in the adapters, the backward's recompute draws the masks the forward drew: its gradients equal
    those of the same shards run with autograd (no recompute)."""
    from llmtrain.model import tiled_mlp

    lora = LoraConfig(r=4, alpha=8.0, dropout=0.3)
    recomputed = train_steps(build(four_layers, lora, tiled_mlp=SHARD), steps=2)
    with monkeypatch.context() as patch:
        patch.setattr(tiled_mlp._TiledMLP, "apply",
                      lambda run, shard, x, *params: torch.cat([run(part) for part in x.split(shard)]))
        kept = train_steps(build(four_layers, lora, tiled_mlp=SHARD), steps=2)
    assert_same(recomputed, kept, exact=False)


def test_the_tiled_backward_holds_one_shard_at_a_time():
    """The tiled backward holds one shard at a time. An fp32 input under bf16 autocast (a full fine-tune in fp32 with
    mixed precision): autocast caches its casts of leaf tensors that need a gradient (meant for weights) until it
    exits, so shards recomputed from leaf slices of the input would each leave a bf16 cast behind until the backward
    ends, a full-length copy of the input by the last shard; and a shard's weight gradients, once added to the sums,
    must not live on through the next shard's (in a full fine-tune, a copy of the MLP's weights). The live bytes as
    each shard's recompute starts stay flat."""
    from live_bytes import LiveBytes
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from llmtrain.model.tiled_mlp import tiled_forward

    hidden, tokens, shard = 64, 1024, 128
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=160))
    x = torch.randn(tokens, hidden, requires_grad=True)
    with LiveBytes() as live:
        starts = []

        def run(part):
            starts.append(live.now)
            return mlp.forward(part)

        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = tiled_forward(run, mlp, shard, x)
        del starts[:]  # the forward's shards
        out.float().sum().backward()
    # From the second shard on (the first makes the gradients' sums and the weights' casts) nothing piles up: neither
    # the input's casts (16 KB a shard here) nor the previous shard's weight gradients (120 KB).
    assert len(starts) == tokens // shard and len(set(starts[1:])) == 1, starts
    assert x.grad is not None and mlp.down_proj.weight.grad is not None


def test_tiled_mlp_evaluates_shard_by_shard(four_layers):
    ids = torch.randint(0, 100, POSITIONS.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = (build(four_layers, **k).eval()(input_ids=ids, position_ids=POSITIONS).logits
                for k in ({}, {"tiled_mlp": SHARD}))
    assert (a - b).abs().max().item() < 1e-5


# --------------------------------------------------------------------------- the training entry


def test_training_with_both_switches_matches_plain_checkpointing(tiny_assets, tmp_path):
    """`llmtrain finetune` (in this process) on packed rows, 3 steps: offload alone gives the plain checkpointed run's
    losses and gradient norms exactly, offload and a tiled MLP to 1e-6."""
    recipe = write_recipe(tiny_assets, tmp_path, model={"gradient_checkpointing": True}, lora={"r": 4, "dropout": 0.0},
                          data={"packing": True}, train={"max_steps": 3}, logging={"every_steps": 1})
    run_train(recipe, f"output_dir={tmp_path / 'plain'}")
    run_train(recipe, f"output_dir={tmp_path / 'offload'}", "model.activation_offload=true")
    run_train(recipe, f"output_dir={tmp_path / 'both'}", "model.activation_offload=true", "model.tiled_mlp=3")
    plain, offload, both = (records(tmp_path / n) for n in ("plain", "offload", "both"))
    assert len(plain) == 3
    assert [(r["loss"], r["grad_norm"]) for r in offload] == [(r["loss"], r["grad_norm"]) for r in plain]
    assert [r["loss"] for r in both] == pytest.approx([r["loss"] for r in plain], abs=1e-6)
    assert [r["grad_norm"] for r in both] == pytest.approx([r["grad_norm"] for r in plain], rel=1e-6)
    # the start-up line says what saves memory
    said = {n: (tmp_path / n / "train.log").read_text() for n in ("plain", "both")}
    assert "; gradient checkpointing\n" in said["plain"]
    assert ("; gradient checkpointing (model.activation_offload: copies layer inputs, but on a CPU the host is the "
            "device: nothing saved), MLP tiled in shards of 3 tokens\n") in said["both"]  # issue 53, item 7


def test_a_preempted_run_with_both_switches_resumes_exactly(tiny_assets, tmp_path, monkeypatch):
    recipe = write_recipe(tiny_assets, tmp_path, lora={"r": 4}, data={"packing": True},
                          model={"gradient_checkpointing": True, "activation_offload": True, "tiled_mlp": 3},
                          checkpoint={"every_steps": 2}, logging={"every_steps": 1})
    run_train(recipe, f"output_dir={tmp_path / 'straight'}")
    crash_at_step(monkeypatch, recipe, 4, f"output_dir={tmp_path / 'cut'}")
    run_train(recipe, f"output_dir={tmp_path / 'cut'}", resume="auto")
    assert losses(tmp_path / "cut") == losses(tmp_path / "straight") and len(losses(tmp_path / "cut")) == 4


def test_a_tiled_mlp_is_refused_by_no_layout_that_trains_it(tiny_assets, tmp_path):
    """Under FSDP x TP it was refused as untested; it trains like one process (tests/test_tp.py)."""
    from llmtrain import capabilities
    from llmtrain.config import load_recipe
    from llmtrain.layout import Layout

    recipe = load_recipe(write_recipe(tiny_assets, tmp_path, model={"tiled_mlp": True}), [])
    assert capabilities.problems(recipe, Layout(processes=4, fsdp=True, mesh=True, shard=2, tp=2)) == []
    assert capabilities.problems(recipe, Layout(processes=2, fsdp=True)) == []


@pytest.mark.slow
# ddp-lora (33 s) and fsdp-lora extended (main tier: fsdp-full's two processes with both switches; the adapters under
# both switches on one process in this file's single-process tests)
@pytest.mark.parametrize("launch, lora", [pytest.param("cpu_ddp", True, marks=pytest.mark.extended),
                                          ("cpu_fsdp", False),
                                          pytest.param("cpu_fsdp", True, marks=pytest.mark.extended)],
                         ids=["ddp-lora", "fsdp-full", "fsdp-lora"])
def test_two_processes_with_both_switches_train_as_one(tiny_assets, tmp_path, free_port, launch, lora):
    """The tiled MLP hands its parameters' gradients to autograd once a step, so DDP reduces each once, and under
    FSDP2 it runs on the layer's unsharded parameters (gathered before the layer's forward and again before its
    backward, where the shards are recomputed) whose gradients FSDP reduce-scatters: 2 gloo processes x micro-batch 2
    equal 1 process x micro-batch 4, offload and tiling on in both."""
    from helpers import REPO, launch_finetune

    recipe = write_recipe(tiny_assets, tmp_path, **({"lora": {"r": 4, "dropout": 0.0}} if lora else {}),
                          train={"max_steps": 3},
                          model={"gradient_checkpointing": True, "activation_offload": True, "tiled_mlp": 3},
                          logging={"every_steps": 1})
    run_train(recipe, f"output_dir={tmp_path / 'one'}")
    out = launch_finetune(REPO / "accelerate_configs" / f"{launch}.yaml", 2, free_port, recipe,
                          f"output_dir={tmp_path / 'two'}", "train.micro_batch_size=2")
    assert "x 2 processes" in out and "MLP tiled in shards of 3 tokens" in out
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert len(two) == 3 and [r["tokens"] for r in two] == [r["tokens"] for r in one]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], abs=1e-5)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-4)


@pytest.mark.extended  # main tier: test_two_processes_with_both_switches_train_as_one
@pytest.mark.slow
def test_offload_under_fsdp_trains_as_plain_checkpointing(tiny_assets, tmp_path, free_port):
    """FSDP2 on 2 gloo processes, full fine-tune with gradient checkpointing: the offload's hooks around each
    checkpointed layer see FSDP's unsharded forward like any other; the losses and gradient norms are the plain
    checkpointed run's exactly."""
    from helpers import REPO, launch_finetune, open_port

    recipe = write_recipe(tiny_assets, tmp_path, train={"max_steps": 3}, model={"gradient_checkpointing": True},
                          logging={"every_steps": 1})
    config = REPO / "accelerate_configs" / "cpu_fsdp.yaml"
    launch_finetune(config, 2, free_port, recipe, f"output_dir={tmp_path / 'plain'}")
    out = launch_finetune(config, 2, open_port(), recipe, f"output_dir={tmp_path / 'offload'}",
                          "model.activation_offload=true")
    assert "model.activation_offload" in out
    assert "on a CPU the host is the device: nothing saved" in (tmp_path / "offload" / "train.log").read_text()
    plain, offload = records(tmp_path / "plain"), records(tmp_path / "offload")
    assert len(plain) == 3
    assert [(r["loss"], r["grad_norm"]) for r in offload] == [(r["loss"], r["grad_norm"]) for r in plain]
