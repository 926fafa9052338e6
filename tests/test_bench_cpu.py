"""`brrr bench latency` runs end to end on CPU (the GPU figures come from the H200; this checks the plumbing)."""
import json
import sys

import pytest
import torch

from brrr.cli import main
from brrr.threads import cpu_threads
from tests import hf_models
from tests.cli import refuses


def test_bench_latency_on_a_model_dir(tmp_path, capsys):
    hf_models.save(hf_models.build("qwen3-qknorm"), tmp_path)
    out = tmp_path / "lat.jsonl"
    assert main(["bench", "latency", "--model", str(tmp_path), "--batch", "1,3", "--prompt-len", "4",
                 "--new-tokens", "6", "--dtype", "float32", "--out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in records] == [1, 3]
    assert all(r["decode_tok_s"] > 0 and r["ttft_s"] > 0 for r in records)


def test_ttft_waits_for_every_prompt_of_a_batch_that_prefills_over_several_steps(tmp_path, monkeypatch):
    """Three 24-token prompts with 16 tokens a step prefill over several steps while the first already decodes:
    TTFT ends at the step where the last of them gets its first token, and only the tokens after it set the decode
    rate (a clock that advances one second a step makes both exact)."""
    import brrr.bench.latency as latency
    from brrr.config import EngineConfig
    from brrr.engine import LLMEngine
    from brrr.loader import load_model

    hf_models.save(hf_models.build("qwen3-qknorm"), tmp_path)
    model = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    engine = LLMEngine(model, None, EngineConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
                                                 num_blocks=32, cuda_graphs=False))
    clock, seen, firsts = [0.0], {}, []
    real_process = engine.processor.process

    def process(*args):  # what each engine.step returns passes here once
        processed = real_process(*args)
        clock[0] += 1.0
        for o in processed.outputs:
            seen[o.request_id] = sum(len(c.token_ids) for c in o.outputs)
        if len(seen) == 3 and all(seen.values()) and not firsts:
            firsts.append((clock[0], sum(seen.values())))
        return processed

    monkeypatch.setattr(engine.processor, "process", process)
    monkeypatch.setattr(latency.time, "perf_counter", lambda: clock[0])
    ttft, decode_s = latency.run_prompts(engine, [[5 + i + j for j in range(24)] for i in range(3)], 8, "t")
    (first_at, made_then), end = firsts[0], clock[0]
    assert ttft == first_at > 2  # the old measure stopped at the first step: 1
    assert decode_s == pytest.approx((end - first_at) * 3 * 7 / (3 * 8 - made_then))


def test_bench_latency_takes_the_kv_cache_flags(tmp_path, capsys):
    """The engine's KV-cache flags reach the engine (SnapKV over a 64-token prompt with a 32-token budget) and
    the record names them; the kept context is what the roofline charges (kept_context)."""
    from brrr.bench.latency import kept_context

    hf_models.save(hf_models.build("qwen3-qknorm"), tmp_path)
    flags = ["--kv-eviction", "snapkv", "--kv-budget", "32"]
    assert main(["bench", "latency", "--model", str(tmp_path), "--prompt-len", "64", "--new-tokens", "6",
                 "--dtype", "float32", *flags]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert record["kv_eviction"] == "snapkv" and record["kv_budget"] == 32 and record["decode_tok_s"] > 0
    parsed = type("Args", (), dict(prompt_len=64, new_tokens=6, kv_eviction="snapkv", kv_budget=32))
    assert kept_context(parsed) == 32 + 3
    parsed.kv_eviction = "streaming"
    assert kept_context(parsed) == 32
    parsed.kv_eviction = None
    assert kept_context(parsed) == 64 + 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="bench latency takes the GPU when there is one")
def test_bench_latency_on_cpu_reports_what_ran(tmp_path, capsys):
    """No CUDA graphs on CPU, whatever --cuda-graphs says; the thread count is chosen, set and reported."""
    hf_models.save(hf_models.build("qwen3-qknorm"), tmp_path)
    before = torch.get_num_threads()
    try:
        for flags, threads in (([], cpu_threads(None)), (["--cpu-threads", "1"], 1)):
            torch.set_num_threads(before)
            assert main(["bench", "latency", "--model", str(tmp_path), "--prompt-len", "4", "--new-tokens", "4",
                         "--dtype", "float32", "--cuda-graphs", "on", *flags]) == 0
            (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
            assert record["cuda_graphs"] == "off" and record["cpu_threads"] == threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)



def test_bench_latency_peer_without_transformers_fails_first(monkeypatch, capsys):
    """Before: brrr's whole half ran, then a raw ModuleNotFoundError. Now: a one-line error before anything runs."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    assert main(["bench", "latency", "--model", "llama-3.1-8b", "--peer", "transformers"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("brrr: error: --peer transformers needs transformers installed") and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU default")
def test_bench_latency_on_cpu_defaults_to_the_shipped_model(capsys):
    """Before: the 8B shape's random weights (15 GB of RAM, 140 s to the first token) without a word."""
    assert main(["bench", "latency", "--prompt-len", "4", "--new-tokens", "4", "--cpu-threads", "1"]) == 0
    captured = capsys.readouterr()
    (record,) = [json.loads(line) for line in captured.out.splitlines()]
    assert record["weights"] == "loaded" and record["model"].endswith("default-model") and record["decode_tok_s"] > 0
    assert "shipped default model" in captured.err


def test_bench_guided_splits_out_the_guided_paths_work(capsys):
    """`brrr bench guided` on the default model: step times for both kinds and, for the guided one, its parts."""
    assert main(["bench", "guided", "--batch", "2", "--steps", "4", "--rounds", "1", "--cpu-threads", "1"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    timed, parts, summary = records[:2], records[2], records[3]
    assert [r["guided"] for r in timed] == [False, True]
    assert all(r["step_ms"] > 0 and r["steps_measured"] > 0 and "mask_fill_ms" not in r for r in timed)
    assert parts["steps"] > 0 and all(parts[k] > 0 for k in ("mask_fill_ms", "mask_apply_ms", "advance_ms"))
    assert summary["guided_vs_unguided_throughput"] == round(timed[0]["step_ms"] / timed[1]["step_ms"], 3)


def test_bench_engine_stats_sees_the_shared_prefix(tmp_path, capsys):
    """`brrr bench engine-stats` on the default model: the second request with the shared 96-token prefix hits the
    first one's cached blocks."""
    out = tmp_path / "stats.jsonl"
    assert main(["bench", "engine-stats", "--requests", "4", "--out", str(out)]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == record
    assert record["bench"] == "engine_stats" and record["requests"] == 4 and record["generation_tokens"] > 0
    assert record["prefix_cache_hits"] >= 6 and 0 < record["peak_block_utilization"] <= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_bench_lora_says_it_measures_a_gpu(capsys):
    refuses(capsys, ["bench", "lora", "--sections", "kernels"], "brrr bench lora measures a GPU")
    refuses(capsys, ["bench", "lora", "--batch", "0"], "--batch must be >= 1, got 0")


def test_bench_serve_overhead_replays_a_serve_runs_requests_offline(tmp_path, capsys):
    """`brrr bench serve-overhead`: the offline LLM generates exactly the requests the `bench serve` run describes
    (ignore_eos: every request its full output_len), and the record sets the two throughputs side by side."""
    run = {"dataset": "random", "num_prompts": 4, "input_len": 16, "output_len": 6, "range_ratio": 0.0,
           "prefix_len": 0, "num_prefixes": 0, "seed": 0, "endpoint": "/v1/completions", "num_warmups": 1,
           "ignore_eos": True, "model": "brrr-default", "request_rate": "inf", "max_concurrency": None,
           "output_throughput": 100.0, "total_output_tokens": 24}
    (tmp_path / "serve.json").write_text(json.dumps(run))
    assert main(["bench", "serve-overhead", "--result", str(tmp_path / "serve.json"), "--cpu-threads", "1"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["offline_generated_tokens"] == record["http_generated_tokens"] == 24
    assert record["http_over_offline"] == pytest.approx(100.0 / record["offline_output_tok_s"])


def test_throughput_profile_sorts_kernels_and_counts_idle_once():
    from brrr.bench.throughput import kernel_categories

    events = [("_prefill_kernel", 0, 30), ("nvjet_tst_128x64", 20, 40), ("_rms_norm_kernel", 70, 5),
              ("triton_poi_fused_copy_0", 90, 5), ("mystery", 95, 5)]
    got = kernel_categories(events, window_us=120)
    assert got["kernel_us"] == {"gemm": 40, "attention": 30, "norm_rope_act": 5, "copy_index": 5, "other": 5}
    assert list(got["top_kernels_us"].items())[:2] == [("nvjet_tst_128x64", 40), ("_prefill_kernel", 30)]
    # overlapping kernels count once: busy is [0, 60) + [70, 75) + [90, 100)
    assert got["busy_us"] == 75 and got["idle_us"] == 45


def test_throughput_splits_the_schedule_by_step_kind():
    from brrr.analysis.hardware import get_gpu
    from brrr.models.random_weights import model_config
    from brrr.bench.throughput import by_step_kind, step_cost

    cfg, gpu = model_config("qwen3-0.6b"), get_gpu("h200")
    schedule = [[(0, 512), (0, 300)], [(512, 1), (300, 1)], [(513, 1), (301, 1)]]
    kinds = by_step_kind(cfg, schedule, [0.01, 0.002, 0.002], gpu, "bf16", 1)
    assert kinds["decode"]["steps"] == 2 and kinds["prefill_or_mixed"]["steps"] == 1
    assert kinds["decode"]["seconds"] == 0.004
    total = sum(step_cost(cfg, items, gpu, "bf16") for items in schedule)
    assert abs(kinds["decode"]["model_seconds"] + kinds["prefill_or_mixed"]["model_seconds"] - total) < 2e-3
    assert kinds["prefill_or_mixed"]["flops_seconds"] > kinds["prefill_or_mixed"]["bytes_seconds"]


def test_prefix_offload_bench_serves_the_evicted_prefix_from_the_host(tmp_path):
    """bench/prefix_offload.py on the shipped model's shape (random weights): the host mode's B finds its whole
    prefix on the host and computes only its own 32 tokens, the recompute mode prefills it all again."""
    import importlib.util
    from pathlib import Path

    from brrr.default_model import default_model_dir

    path = Path(__file__).resolve().parents[1] / "bench" / "prefix_offload.py"
    spec = importlib.util.spec_from_file_location("prefix_offload", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.jsonl"
    bench.main(["--model", str(default_model_dir()), "--lengths", "64", "--max-num-batched-tokens", "128",
                "--out", str(out)])
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["host_hits_host"] == 64 and rec["prompt_tokens_host"] == 32
    assert rec["host_hits_device"] == 0 and rec["prompt_tokens_device"] == 32
    assert rec["host_hits_recompute"] == 0 and rec["prompt_tokens_recompute"] == 96
    assert all(rec[f"ttft_{m}_s"] > 0 for m in ("device", "host", "recompute"))
