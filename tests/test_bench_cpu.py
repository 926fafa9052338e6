"""`brrr bench latency` runs end to end on CPU (the GPU figures come from the H200; this checks the plumbing)."""
import json

from brrr.cli import main
from tests import hf_models


def test_bench_latency_on_a_model_dir(tmp_path, capsys):
    hf_models.save(hf_models.build("qwen3-qknorm"), tmp_path)
    out = tmp_path / "lat.jsonl"
    assert main(["bench", "latency", "--model", str(tmp_path), "--batch", "1,3", "--prompt-len", "4",
                 "--new-tokens", "6", "--dtype", "float32", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in records] == [1, 3]
    assert all(r["decode_tok_s"] > 0 and r["ttft_s"] > 0 for r in records)
