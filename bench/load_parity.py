"""Load a Llama-3.1-8B-shaped random checkpoint saved by transformers, time the load and peak GPU memory, and check
64 greedy tokens against transformers. Prints one JSON record per result (DESIGN.md's benchmark convention).

    python bench/load_parity.py --out bench/results/load_parity_h200.jsonl
"""
import argparse
import gc
import json
import os
import platform
import tempfile
import time

import torch
import transformers

import brrr
from brrr.presets import PRESETS

# The published Llama-3.1-8B config.json (brrr.presets), as transformers builds it.
LLAMA_31_8B = {k: v for k, v in PRESETS["llama-3.1-8b"].items() if k != "model_type"}


def record(**kw):
    rec = {"machine": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
           "torch": torch.__version__, "transformers": transformers.__version__, **kw}
    print(json.dumps(rec), flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where to save the checkpoint (default: a temp dir)")
    args = ap.parse_args()
    records = []
    device = "cuda"
    cfg = transformers.LlamaConfig(**LLAMA_31_8B, dtype=torch.bfloat16)
    workdir = args.dir or tempfile.mkdtemp(prefix="brrr-8b-")
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    t0 = time.perf_counter()
    hf.save_pretrained(workdir)
    save_s = time.perf_counter() - t0
    del hf  # the reference is transformers loading the checkpoint, as a user would (keeps RoPE buffers in fp32)
    gc.collect(), torch.cuda.empty_cache()
    size = sum(os.path.getsize(os.path.join(workdir, f)) for f in os.listdir(workdir) if f.endswith(".safetensors"))

    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf = transformers.LlamaForCausalLM.from_pretrained(workdir, dtype=torch.bfloat16, device_map=device).eval()
    torch.cuda.synchronize()
    records.append(record(bench="load_and_parity", model="llama-3.1-8b shape (random, bf16)", runner="transformers",
                          load_s=round(time.perf_counter() - t0, 2), peak_gpu_bytes=torch.cuda.max_memory_allocated(),
                          attn_implementation=hf.config._attn_implementation))
    prompt = torch.tensor([[128000, 791, 4062, 14198, 39935]], device=device)  # 5 tokens
    gen = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=args.steps, min_new_tokens=args.steps,
               do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf.generate(prompt, **gen)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        expected = hf.generate(prompt, **gen)[0, prompt.shape[1]:].tolist()
        torch.cuda.synchronize()
    records.append(record(bench="reference_decode", model="llama-3.1-8b shape (random, bf16)",
                          runner="transformers generate (eager)", batch=1, prompt_tokens=prompt.shape[1],
                          new_tokens=args.steps, tok_s_incl_prefill=round(args.steps / (time.perf_counter() - t0), 1)))
    del hf
    gc.collect(), torch.cuda.empty_cache()

    # The checkpoint was just written, so its pages are in the OS cache: these are warm-cache load times.
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = brrr.load_model(workdir, dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    got = list(brrr.generate_tokens(model, prompt[0].tolist(), brrr.SamplingParams(max_tokens=args.steps,
                                                                                    temperature=0)))
    first_diff = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    records.append(record(bench="load_and_parity", model="llama-3.1-8b shape (random, bf16)", runner="brrr",
                          checkpoint_bytes=size, save_s=round(save_s, 2), load_s=round(load_s, 2),
                          load_gb_per_s=round(size / load_s / 1e9, 2), peak_gpu_bytes=peak, weight_bytes=weights,
                          peak_over_weights=round(peak / weights, 4), greedy_steps=args.steps,
                          greedy_match=got == expected, first_mismatch=first_diff, brrr_tokens=got[:16],
                          hf_tokens=expected[:16]))

    # Reference decode speed (eager, one sequence, contiguous cache): the floor the GPU fast path starts from.
    from brrr.analysis.hardware import measure
    from brrr.analysis.model import decode_bytes_per_step

    gpu = measure()
    params = brrr.SamplingParams(max_tokens=args.steps, temperature=0)
    list(brrr.generate_tokens(model, prompt[0].tolist(), params))  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stamps = [time.perf_counter() for _ in brrr.generate_tokens(model, prompt[0].tolist(), params)]
    ttft, decode_s = stamps[0] - t0, stamps[-1] - stamps[0]
    decode_tok_s = (len(stamps) - 1) / decode_s
    mean_ctx = prompt.shape[1] + args.steps // 2
    roofline_tok_s = gpu.bandwidth / decode_bytes_per_step(model.config, 1, mean_ctx)
    records.append(record(bench="reference_decode", model="llama-3.1-8b shape (random, bf16)", runner="brrr eager",
                          batch=1, prompt_tokens=prompt.shape[1], new_tokens=args.steps, ttft_s=round(ttft, 4),
                          tok_s_incl_prefill=round(args.steps / (stamps[-1] - t0), 1),
                          decode_tok_s=round(decode_tok_s, 1), measured_bandwidth=round(gpu.bandwidth),
                          roofline_tok_s=round(roofline_tok_s, 1),
                          fraction_of_roofline=round(decode_tok_s / roofline_tok_s, 3)))
    if args.out:
        with open(args.out, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
