"""brrr dpo against TRL's DPOTrainer: on the same tiny model (a perturbed policy, the original as reference), data
and beta, the loss, TRL's logged rewards and every parameter's gradient agree to 1e-5 for sigmoid and ipo (TRL's
compute_loss on one batch of its own collator, no training run). Then brrr dpo runs end to end: full-parameter
(reference precomputed) and LoRA (the base with the adapter off is the reference), whose adapter loads in PEFT."""
import copy
import json
import math

import pytest
import torch

from brrr.cli import main
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.lora import load_adapter
from brrr.lora.layers import load_lora_state
from brrr.loader import load_model
from brrr.tokenizer import Tokenizer
from brrr.train.dpo import DPOConfig
from brrr.train.dpo_loss import dpo_loss
from brrr.train.logprobs import sequence_sums, token_logprobs
from brrr.train.preference_data import load_preferences, pair_batch
from brrr.train.trainer import Trainer
from tests.hf_models import build, save, save_tokenizer

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

PAIRS = [{"prompt": "def add(a, b):", "chosen": " return a + b", "rejected": " return a - b"},
         {"prompt": "Hello, ", "chosen": "world!", "rejected": "the lazy dog jumps"},
         {"prompt": [{"role": "user", "content": "Say hello"}],
          "chosen": [{"role": "assistant", "content": "Hello, world!"}],
          "rejected": [{"role": "assistant", "content": "def add"}]}]
CHAT = [PAIRS[2], {"prompt": [{"role": "user", "content": "Add?"}],
                   "chosen": [{"role": "assistant", "content": "a + b"}],
                   "rejected": [{"role": "assistant", "content": "no"}]}]
IMPLICIT = {"chosen": CHAT[1]["prompt"] + CHAT[1]["chosen"], "rejected": CHAT[1]["prompt"] + CHAT[1]["rejected"]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(reference dir, policy dir): a tiny model and a copy with every weight moved."""
    ref = build("llama3-rope", vocab_size=320)
    policy = copy.deepcopy(ref)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return (save_tokenizer(save(ref, tmp_path_factory.mktemp("ref"))),
            save_tokenizer(save(policy, tmp_path_factory.mktemp("policy"))))


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trl_loss(dirs, rows, beta, loss_type, tmp_path):
    from datasets import Dataset

    tok = transformers.AutoTokenizer.from_pretrained(dirs[1])
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs[1], dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[loss_type], report_to=[],
                         per_device_train_batch_size=len(rows), use_cpu=True, max_length=64,
                         bf16=False)  # TRL defaults to bf16 autocast; the oracle is fp32
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), metrics, {n: p.grad for n, p in model.named_parameters()}


def brrr_loss(dirs, data, beta, loss_type):
    tokenizer = Tokenizer.from_dir(dirs[1])
    pairs, _ = load_preferences(data, tokenizer, 64)
    ids, targets, positions, meta, lengths, counts = pair_batch(pairs, "cpu")
    policy, ref = load_model(dirs[1], dtype=torch.float32), load_model(dirs[0], dtype=torch.float32)
    policy.requires_grad_(True)
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_sums(*token_logprobs(ref, ids, targets, positions, meta), lengths).chunk(2)
    logps, rows = token_logprobs(policy, ids, targets, positions, meta)
    chosen, rejected = sequence_sums(logps, rows, lengths).chunk(2)
    loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, loss_type, *counts.chunk(2))
    loss.backward()
    return loss.detach(), {k: v.mean().item() for k, v in metrics.items()}, \
        {n: p.grad for n, p in policy.named_parameters()}


@pytest.mark.parametrize("loss_type,rows", [("sigmoid", PAIRS[:2]), ("ipo", PAIRS[:2]), ("sigmoid", CHAT),
                                           ("ipo", CHAT)], ids=["sigmoid", "ipo", "sigmoid-chat", "ipo-chat"])
def test_loss_rewards_and_gradients_equal_trl(dirs, tmp_path, loss_type, rows):
    # a datasets column holds one type: TRL takes the text pairs and the conversational ones apart
    beta = 0.1 if loss_type == "sigmoid" else 0.5
    theirs, their_metrics, their_grads = trl_loss(dirs, rows, beta, loss_type, tmp_path)
    mine, my_metrics, my_grads = brrr_loss(dirs, write(tmp_path / "p.jsonl", rows), beta, loss_type)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert abs(their_metrics["rewards/margins"]) > 1e-3  # the policy differs from its reference
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected"):
        assert my_metrics[key] == pytest.approx(their_metrics[key], rel=1e-5, abs=1e-5), key
    assert set(my_grads) == set(their_grads)
    for name, g in their_grads.items():
        torch.testing.assert_close(my_grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def _cfg(model, data, out, **kw):
    base = dict(seq_len=64, micro_batch=3, max_steps=8, lr=2e-3, log_every=4, checkpoint_every=8, beta=0.5)
    return DPOConfig(str(model), str(data), str(out), **{**base, **kw})


def test_full_parameter_dpo_learns_the_preference(dirs, tmp_path):
    data = write(tmp_path / "p.jsonl", PAIRS * 2)
    summary = Trainer(_cfg(dirs[0], data, tmp_path / "out")).run()
    log = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert steps[-1]["rewards/margins"] > steps[0]["rewards/margins"] and steps[-1]["rewards/accuracies"] == 1.0
    assert summary["pairs"] == 6
    reloaded = load_model(tmp_path / "out", dtype=torch.float32)  # an HF directory brrr (and transformers) loads
    assert (tmp_path / "out" / "tokenizer.json").is_file() and reloaded.config.num_layers == 2


def test_lora_dpo_adapter_loads_in_peft(dirs, tmp_path):
    peft = pytest.importorskip("peft")
    data = write(tmp_path / "p.jsonl", PAIRS * 2)
    out = tmp_path / "lora"
    rc = main(["dpo", "--model", str(dirs[0]), "--data", str(data), "--out", str(out), "--use-peft", "--lora-r", "4",
               "--lora-dropout", "0", "--max-steps", "6", "--learning-rate", "5e-3", "--micro-batch", "3",
               "--log-every", "3", "--max-length", "64", "--beta", "0.5"])
    assert rc == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if '"loss"' in line]
    # step 1's policy is the reference (B = 0), so the first loss is ln 2; the margins grow from there
    first = log[0]
    assert first["loss"] < math.log(2) + 1e-6 and log[-1]["rewards/margins"] > 0
    base = transformers.AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32)
    ids = torch.tensor([Tokenizer.from_dir(dirs[0]).encode(PAIRS[0]["prompt"] + PAIRS[0]["chosen"])])
    n = ids.shape[1]
    with torch.no_grad():
        before = base(input_ids=ids).logits
    theirs = peft.PeftModel.from_pretrained(base, out).eval()  # wraps base in place
    mine = load_model(dirs[0], dtype=torch.float32)
    load_lora_state(mine, load_adapter(out))
    with torch.no_grad():
        logits = mine.compute_logits(mine(ids[0], torch.arange(n), AttnMeta.causal([n], "cpu")))
        torch.testing.assert_close(logits, theirs(input_ids=ids).logits[0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(theirs(input_ids=ids).logits, before, atol=1e-3)


def test_bad_rows_name_the_line(dirs, tmp_path):
    tokenizer = Tokenizer.from_dir(dirs[0])
    explicit, implicit = load_preferences(write(tmp_path / "i.jsonl", [CHAT[1], IMPLICIT]), tokenizer, 64)[0]
    assert (explicit.prompt, explicit.chosen, explicit.rejected) == (implicit.prompt, implicit.chosen,
                                                                     implicit.rejected)  # TRL's extract_prompt
    with pytest.raises(BrrrError, match=r"line 2: .*\"chosen\" and \"rejected\""):
        load_preferences(write(tmp_path / "a.jsonl", [PAIRS[0], {"prompt": "x", "chosen": "y"}]), tokenizer, 64)
    with pytest.raises(BrrrError, match="--loss-type"):
        Trainer(_cfg(dirs[0], write(tmp_path / "b.jsonl", PAIRS), tmp_path / "o", loss_type="kto"))
