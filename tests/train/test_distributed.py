"""`brrr train` on 2 and 4 CPU processes (gloo) against one process with the same global batch: DDP, FSDP2 as
ZeRO-3 and ZeRO-2, HSDP, TP (sequence parallel, vocab-parallel loss), FSDP x TP, and PP with GPipe, 1F1B and
interleaved 1F1B (alone, with FSDP, with TP). Every layout gives the one-process loss curve and final weights within
fp32 reduction-order tolerance: losses within 5e-5 absolute (they differ in the 6th digit: the layouts sum the
same fp32 products in another order), weights within 1e-4. A DCP checkpoint written by 4 FSDP ranks resumes on 2
ranks of TP and then on one process, continuing the uninterrupted curve; a layout the world or the model cannot
take is refused on every rank before any collective."""
import json

import pytest
import torch
from safetensors.torch import load_file

from brrr.analysis.train import stage_layers
from brrr.errors import BrrrError
from brrr.train.parallel.layout import Layout, check_model
from brrr.train.parallel.pipeline import check_pipeline
from brrr.train.shapes import resolve_config
from brrr.train.trainer import TrainConfig, Trainer
from tests.train.conftest import TINY_MODEL
from tests.train.distributed_helpers import spawn, train_losses

LOSS_ATOL, WEIGHT_ATOL = 5e-5, 1e-4
GLOBAL_MICRO_BATCH = 8  # sequences per micro-batch over all data-parallel ranks; 2 micro-batches a step


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """The tiny model (2 layers), a 4-layer one for interleaved pipelines (2 stages per rank), and one whose LM
    head shares the embedding's weight (TP shards the shared table once), and a Qwen3 (per-head q/k norms, which
    under TP see each rank's heads)."""
    d = tmp_path_factory.mktemp("dist_cfg")
    shapes = {"two": TINY_MODEL, "four": {**TINY_MODEL, "num_hidden_layers": 4},
              "tied": {**TINY_MODEL, "tie_word_embeddings": True},
              "qwen3": {**TINY_MODEL, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}}
    for name, shape in shapes.items():
        (d / f"{name}.json").write_text(json.dumps(shape))
    return {name: d / f"{name}.json" for name in shapes}


def _cfg(model, data_dir, out, dp: int, **kw) -> TrainConfig:
    base = dict(device="cpu", seq_len=32, micro_batch=GLOBAL_MICRO_BATCH // dp, grad_accum=2, max_steps=10,
                lr=3e-3, warmup_steps=2, eval_every=100, eval_windows=2, log_every=1, checkpoint_every=100,
                final_eval_windows=2)
    return TrainConfig(str(model), str(data_dir), str(out), **{**base, **kw})


# name: (world, model, data-parallel ranks, layout flags)
CASES = {
    "ddp": (2, "two", 2, dict(dp_replicate=2)),
    "fsdp_zero3": (2, "two", 2, dict(async_checkpoint=True, checkpoint_every=3)),
    "fsdp_zero2": (2, "two", 2, dict(reshard_after_forward=False)),
    "fsdp_recompute_every_2nd": (2, "four", 2, dict(activation_checkpointing=True, activation_checkpointing_every=2)),
    "tp": (2, "two", 1, dict(tp=2)),
    "pp_gpipe": (2, "two", 1, dict(pp=2, pp_schedule="gpipe", microbatches=4)),
    "pp_1f1b": (2, "two", 1, dict(pp=2, pp_schedule="1f1b", microbatches=2)),
    "pp_interleaved": (2, "four", 1, dict(pp=2, pp_schedule="interleaved", microbatches=2)),
    "hsdp": (4, "two", 4, dict(dp_replicate=2)),
    "fsdp_x_tp": (4, "two", 2, dict(tp=2)),
    "fsdp_x_tp_tied": (4, "tied", 2, dict(tp=2)),
    "fsdp_x_tp_qwen3": (4, "qwen3", 2, dict(tp=2)),
    "pp_x_fsdp": (4, "four", 2, dict(pp=2, microbatches=2)),
    "pp_x_tp_interleaved": (4, "four", 1, dict(pp=2, tp=2, pp_schedule="interleaved", microbatches=2)),
}


@pytest.fixture(scope="module")
def runs(configs, data_dir, tmp_path_factory):
    """Every case trained: 4-rank cases in one process group, 2-rank cases in another (the DCP round trip's
    first leg runs with the 4-rank ones, its second with the 2-rank ones, its last in this process)."""
    root = tmp_path_factory.mktemp("dist_runs")
    outs = {name: root / name for name in CASES}
    for model in sorted({case[1] for case in CASES.values()}):
        outs[f"single_{model}"] = root / f"single_{model}"
        Trainer(_cfg(configs[model], data_dir, outs[f"single_{model}"], 1)).run()
    trip = root / "round_trip"
    by_world = {2: [], 4: [_cfg(configs["two"], data_dir, trip, 4, stop_at=5, async_checkpoint=True)]}
    for name, (world, model, dp, flags) in CASES.items():
        by_world[world].append(_cfg(configs[model], data_dir, outs[name], dp, **flags))
    by_world[2].append(_cfg(configs["two"], data_dir, trip, 1, tp=2, stop_at=7, resume=True))
    outs["fsdp_fp16"] = root / "fsdp_fp16"
    by_world[2].append(_cfg(configs["two"], data_dir, outs["fsdp_fp16"], 2, fp16=True))
    spawn(4, by_world[4])
    spawn(2, by_world[2])
    Trainer(_cfg(configs["two"], data_dir, trip, 1, resume=True)).run()
    outs["round_trip"] = trip
    return outs


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_one_process(runs, name):
    model = CASES[name][1]
    ref, out = runs[f"single_{model}"], runs[name]
    assert train_losses(out) == pytest.approx(train_losses(ref), abs=LOSS_ATOL)
    want, got = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=WEIGHT_ATOL, rtol=0, msg=key)
    summary = json.loads((out / "train_summary.json").read_text())
    reference = json.loads((ref / "train_summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(reference["val_loss"], abs=LOSS_ATOL)
    assert summary["tokens_seen"] == reference["tokens_seen"] == 10 * 2 * GLOBAL_MICRO_BATCH * 32


def test_a_distributed_export_loads_in_transformers_and_brrr(runs):
    """Rank 0 gathers the final checkpoint's shards (here FSDP x TP) into the HF directory one process writes."""
    transformers = pytest.importorskip("transformers")
    import brrr

    out, ref = runs["fsdp_x_tp"], runs["single_two"]
    assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    ids = [0, 17, 42, 99, 250, 3, 7, 311]
    with torch.no_grad():
        ours = brrr.forward_logits(brrr.load_model(out), ids)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ref_logits = theirs(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref_logits, atol=1e-4, rtol=0)


def test_dcp_checkpoint_resumes_across_layouts(runs):
    """Steps 1-5 on 4 FSDP ranks (saved asynchronously), 6-7 on 2 TP ranks, 8-10 on one process: the
    uninterrupted curve."""
    trip, ref = runs["round_trip"], runs["single_two"]
    assert train_losses(trip) == pytest.approx(train_losses(ref), abs=LOSS_ATOL)
    want, got = load_file(ref / "model.safetensors"), load_file(trip / "model.safetensors")
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=WEIGHT_ATOL, rtol=0, msg=key)


def test_fsdp_in_fp16_follows_fp32_with_a_loss_scale(runs):
    """FSDP2 with fp16 weights and compute (fp32 reduction and master weights) and dynamic loss scaling: the fp32
    curve within fp16's rounding (5e-2), the scale logged every step."""
    log = [json.loads(line) for line in (runs["fsdp_fp16"] / "train_log.jsonl").read_text().splitlines()
           if '"loss"' in line]
    assert [r["loss"] for r in log] == pytest.approx(train_losses(runs["single_two"]), abs=5e-2)
    assert all(r["loss_scale"] == 2.0**16 and r["overflow_steps"] == 0 for r in log)


def _model_cfg(data_dir, path):
    from brrr.token_data import TokenData

    data = TokenData(data_dir)
    return resolve_config(str(path), data.vocab_size, data.special_tokens, 32)


def test_bad_layouts_are_refused_with_the_flag_and_the_world_size(configs, data_dir):
    with pytest.raises(BrrrError, match=r"--dp-replicate 1 x --dp-shard 3 x --tp 1 x --pp 1 = 3, but the world "
                                        r"size is 4"):
        Layout(dp_shard=3).resolve(4)
    with pytest.raises(BrrrError, match=r"--dp-replicate 1 x --tp 3 x --pp 1 = 3 does not divide the world size 4"):
        Layout(tp=3).resolve(4)
    with pytest.raises(BrrrError, match="--tp must be >= 1"):
        Layout(tp=0).resolve(2)
    cfg = _model_cfg(data_dir, configs["two"])
    with pytest.raises(BrrrError, match=r"--tp 4 must divide the model's num_key_value_heads \(2\)"):
        check_model(Layout(dp_shard=1, tp=4), cfg, 8, 32)
    with pytest.raises(BrrrError, match=r"--tp 3 must divide the model's num_attention_heads \(4\)"):
        check_model(Layout(dp_shard=1, tp=3), cfg, 8, 32)
    with pytest.raises(BrrrError, match="--pp 4 stages need at least that many layers; the model has "
                                        "num_hidden_layers 2"):
        check_model(Layout(dp_shard=1, pp=4), cfg, 8, 32)
    with pytest.raises(BrrrError, match=r"--pp 2 with --pp-schedule interleaved makes 4 stages, more than the "
                                        r"model's num_hidden_layers 2"):
        check_pipeline("interleaved", 2, 2, 2)
    with pytest.raises(BrrrError, match=r"--microbatches 3 must divide --micro-batch 8"):
        check_model(Layout(dp_shard=1, pp=2), cfg, 8, 32, microbatches=3)


def test_stages_split_layers_evenly_with_the_head_weighed_on_the_last():
    assert stage_layers(4, 2) == [[0, 1], [2, 3]]
    assert stage_layers(5, 2) == [[0, 1], [2, 3, 4]]  # equally busy: the spare layer last, not on the first
    assert stage_layers(4, 4) == [[0], [1], [2], [3]]
    # a head worth 3.8 layers (llama-3.2-1b's): 5/5/5/1 runs at 5 layers' pace, 4/4/4/4 at 7.8
    assert [len(s) for s in stage_layers(16, 4, 3.8)] == [5, 5, 5, 1]
    # of equally busy splits the one with more layers last: 9/9/8/6 and 9/9/9/5 both pace at 9
    assert [len(s) for s in stage_layers(32, 4, 2.2)] == [9, 9, 8, 6]
    assert stage_layers(4, 4, 10.0) == [[0], [1], [2], [3]]  # every stage keeps a layer


def test_measured_bubble_is_the_busiest_ranks_idle_share_of_the_whole_pipeline():
    from brrr.train.parallel.pipeline import measured_bubble

    # 1F1B, p = 2, m = 2, t_f = 1, t_b = 2: both stages compute 6 of a 9-unit pipeline, (p - 1) / (m + p - 1) = 1/3
    # idle; the last stage's own schedule call ends at its last backward, 2 units before the first stage's
    got = measured_bubble([(6.0, 9.0), (6.0, 7.0)])
    assert got["pp_bubble"] == pytest.approx(1 / 3) and got["pp_stage_imbalance"] == pytest.approx(1.0)
    # a last stage with twice the work sets the pace: its idle share, and 2x the others' compute over the mean
    got = measured_bubble([(6.0, 16.0), (12.0, 15.0)])
    assert got["pp_bubble"] == pytest.approx(1 - 12 / 16) and got["pp_stage_imbalance"] == pytest.approx(12 / 9)


def test_selective_recompute_wraps_every_nth_layer(configs, data_dir):
    from brrr.train.parallel import parallelize, plan_layout
    from brrr.train.pretrain import build_model

    model_cfg = _model_cfg(data_dir, configs["four"])
    cfg = _cfg(configs["four"], data_dir, "unused", 1, activation_checkpointing=True, activation_checkpointing_every=2)
    device = torch.device("cpu")
    mesh = plan_layout(cfg.parallel, model_cfg, cfg.loop.micro_batch, cfg.loop.seq_len, device)
    model, _ = parallelize(build_model(model_cfg, "cpu"), mesh, cfg.parallel, device, grad_accum=cfg.loop.grad_accum,
                           seq_len=cfg.loop.seq_len, activation_checkpointing=cfg.task.activation_checkpointing,
                           checkpoint_every=cfg.task.activation_checkpointing_every)
    wrapped = ["forward" in layer.__dict__ for layer in model.model.layers]  # an instance forward: the recompute
    assert wrapped == [True, False, True, False]


@pytest.mark.parametrize("grad", [True, False])
def test_a_stage_forward_takes_the_reference_ops_in_either_grad_mode(configs, data_dir, grad):
    """PipelineStage infers a stage's output metadata from a forward under no_grad and checks each training
    forward against it: on CUDA no_grad would take the Triton kernels, so a stage always runs the references."""
    from brrr.kernels import dispatch
    from brrr.train.parallel.pipeline import PipelineStageModule
    from brrr.train.pretrain import build_model

    model_cfg = _model_cfg(data_dir, configs["four"])
    stages = [PipelineStageModule(build_model(model_cfg, "cpu"), layers, s == 0, s == 1, 32)
              for s, layers in enumerate(stage_layers(4, 2))]
    seen = []
    for stage in stages:
        layer = next(iter(stage.model.layers.values()))
        layer.register_forward_pre_hook(lambda *_: seen.append(dispatch._forced_reference > 0))
    ids = torch.randint(0, model_cfg.vocab_size, (2, 32))
    with torch.set_grad_enabled(grad):
        h, residual = stages[0](ids)
        out = stages[1](h, residual)
    assert out.shape == (64, model_cfg.hidden_size)  # the final hidden states: the chunked loss takes them
    assert seen == [True, True]
