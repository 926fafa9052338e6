"""SFT data: JSONL parsing errors with line numbers, loss masks on assistant / completion tokens only, packing into
rows, and packed documents that never attend to each other (the same logits as run one by one)."""
import json

import numpy as np
import pytest
import torch

from brrr.default_model import default_model_dir
from brrr.errors import BrrrError
from brrr.kernels import AttnMeta
from brrr.loader import load_model
from brrr.tokenizer import Tokenizer
from brrr.train.sft import IGNORE, Document, PackedRows, encode_example, load_sft, pack, read_jsonl


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(default_model_dir())


def _trained_text(tok, record):
    ids, trained = encode_example(tok, record, "test")
    return tok.decode([int(i) for i, t in zip(ids, trained) if t], skip_special_tokens=False), ids, trained


def test_chat_loss_mask_covers_assistant_turns_only(tok):
    record = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Color?"},
                           {"role": "assistant", "content": "Blue."}]}
    text, ids, trained = _trained_text(tok, record)
    assert text == "Hello.<|im_end|>\nBlue.<|im_end|>\n"
    whole = tok.apply_chat_template(record["messages"], add_generation_prompt=False)
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == whole
    # the prompt pieces are what inference encodes: the conversation up to the generation prompt
    first = int(np.argmax(trained))
    prompt = tok.encode_chat(record["messages"][:2], add_generation_prompt=True)
    assert ids[:first].tolist() == prompt


def test_prompt_completion_trains_the_completion_and_eos(tok):
    text, ids, trained = _trained_text(tok, {"prompt": "def f():\n    return", "completion": " 1\n"})
    assert text == " 1\n<|eos|>" and ids[0] == tok.bos_token_id and not trained[0]


def test_malformed_input_names_the_line(tmp_path, tok):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n\n{"messages": [}\n')
    with pytest.raises(BrrrError, match=r"bad.jsonl, line 3: not valid JSON"):
        read_jsonl(bad)
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(BrrrError, match=r"line 2: no assistant message"):
        load_sft(bad, tok, 64, 0.0, 0)
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(BrrrError, match=r"line 1: expected \"messages\""):
        load_sft(bad, tok, 64, 0.0, 0)
    bad.write_text('[1, 2]\n')
    with pytest.raises(BrrrError, match=r"line 1: expected a JSON object"):
        read_jsonl(bad)


def test_pack_places_every_document_once_within_the_row():
    lengths = [50, 7, 33, 64, 1, 20, 20, 40, 9]
    docs = [Document(np.zeros(n, np.int64), np.zeros(n, np.int64)) for n in lengths]
    rows = pack(docs, 64)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert len(rows) == -(-sum(lengths) // 64)  # best fit reaches the lower bound here


def test_packed_documents_never_attend_across(tok):
    model = load_model(default_model_dir(), dtype=torch.float32)
    records = [{"messages": [{"role": "user", "content": f"Name {w}."},
                             {"role": "assistant", "content": f"{w} it is."}]}
               for w in ("red", "a blue whale", "green")] + [{"prompt": "x = ", "completion": "42"}]
    docs = []
    for r in records:
        ids, trained = encode_example(tok, r, "test")
        docs.append(Document(ids[:-1], np.where(trained[1:], ids[1:], IGNORE)))
    rows = PackedRows(docs, 96, pad_id=2)
    assert len(rows) == 1 and rows.trained_tokens == sum(int((d.targets != IGNORE).sum()) for d in docs)
    ids, targets, positions, meta = rows.batch([0], "cpu")
    assert meta.seqlens_q[:-1] == [len(docs[i].inputs) for i in pack(docs, 96)[0]]  # the tail is padding
    with torch.no_grad():
        packed = model.compute_logits(model(ids, positions, meta))
        at = 0
        for n in meta.seqlens_q:
            alone = model.compute_logits(model(ids[at:at + n], torch.arange(n), AttnMeta.causal([n], "cpu")))
            assert positions[at:at + n].tolist() == list(range(n))
            torch.testing.assert_close(packed[at:at + n], alone, rtol=1e-5, atol=1e-5)
            at += n


def test_held_out_split_is_disjoint_and_stable(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"n{i} =", "completion": f" {i}"}) + "\n" for i in range(20)))
    train, val, stats = load_sft(data, tok, 32, 0.2, seed=3)
    again = load_sft(data, tok, 32, 0.2, seed=3)[1]
    assert stats["train_examples"] == 16 and stats["val_examples"] == 4
    assert np.array_equal(val.inputs, again.inputs)
    with pytest.raises(BrrrError, match="too few"):
        data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
        load_sft(data, tok, 32, 0.5, seed=0)
