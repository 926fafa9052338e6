"""`brrr bench serve-overhead`: the offline `LLM`'s output tok/s on exactly the requests a `brrr bench serve` run
sent, beside that run's output tok/s through HTTP. Issue 5's bar: at saturation (--request-rate inf) HTTP >= 90% of
offline.

    brrr serve --model M &                                   # same engine settings as below
    brrr bench serve --request-rate inf --num-prompts 256 --save-result serve.json
    brrr bench serve-overhead --result serve.json --model M

Prints one JSON record: both throughputs, their ratio, the workload and the machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

from brrr.bench.datasets import pseudo_text, synthetic_prompts

from brrr.engine import LLM

from brrr.engine.engine_process import engine_stats, write_trace

from brrr.engine.engine_process_warmup import warm_up

from brrr.sampling_params import SamplingParams



def register(bench_sub) -> None:
    p = bench_sub.add_parser("serve-overhead", help="HTTP vs offline output tok/s on a `bench serve` run's requests",
                             description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--result", required=True, help="JSON written by `brrr bench serve --save-result`")
    p.add_argument("--model", default=None, help="the model the server ran (default: brrr's default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads on CPU (default: all cores but one, as brrr serve's engine has)")
    p.add_argument("--trace", default=None,
                   help="write one line per engine step (as BRRR_ENGINE_TRACE does for the server's engine)")
    p.set_defaults(func=cmd_serve_overhead)


def cmd_serve_overhead(args) -> int:
    import torch

    run = json.loads(open(args.result).read())
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    if next(llm.pretrained.model.parameters()).device.type == "cpu":
        torch.set_num_threads(args.cpu_threads or max(1, torch.get_num_threads() - 1))
    tok = llm.tokenizer
    pool = sorted(set(tok.encode(pseudo_text(3000), add_special_tokens=False)))  # what the server's /tokenize gave
    prompts = synthetic_prompts(run["dataset"], pool, run["num_prompts"], run["input_len"], run["output_len"],
                                run["range_ratio"], run["prefix_len"], max(run["num_prefixes"], 1), run["seed"])
    if run["endpoint"].endswith("/chat/completions"):
        inputs = [tok.encode_chat([{"role": "user", "content": tok.decode(p.token_ids, skip_special_tokens=False)}])
                  for p in prompts]
    else:
        inputs = [p.token_ids for p in prompts]
    params = [SamplingParams(max_tokens=p.output_len, temperature=0.0, ignore_eos=run["ignore_eos"]) for p in prompts]
    warm_up(llm.engine)  # what `brrr serve` does before it listens: no kernel compiles inside the timed run
    # and the benchmark's own warm-up requests, as it sent them (its first prompts, at most 16 tokens): the same
    # prompts then sit in the prefix cache for both runs
    warm = min(run["num_warmups"], len(inputs))
    llm.generate(inputs[:warm], [SamplingParams(max_tokens=min(prompts[0].output_len, 16), temperature=0.0,
                                                ignore_eos=run["ignore_eos"])] * warm, use_tqdm=False)
    device = next(llm.pretrained.model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if args.trace:
        trace, step = [], llm.engine.step

        def traced_step(*a, **k):
            begin = time.perf_counter()
            out = step(*a, **k)
            end = time.perf_counter()
            trace.append((begin, end, end, engine_stats(llm.engine)))
            return out

        llm.engine.step = traced_step
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if args.trace:
        llm.engine.step = step
        write_trace(args.trace, trace)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    offline = generated / seconds
    print(json.dumps({
        "what": "server overhead: output tok/s through HTTP (brrr bench serve) vs the offline LLM, same requests",
        "model": run["model"], "endpoint": run["endpoint"], "dataset": run["dataset"],
        "num_prompts": run["num_prompts"], "input_len": run["input_len"], "output_len": run["output_len"],
        "request_rate": run["request_rate"], "max_concurrency": run["max_concurrency"],
        "http_output_tok_s": run["output_throughput"], "offline_output_tok_s": offline,
        "http_over_offline": run["output_throughput"] / offline, "offline_seconds": seconds,
        "offline_generated_tokens": generated, "http_generated_tokens": run["total_output_tokens"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
    }))
    return 0
