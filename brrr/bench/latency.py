"""`brrr bench latency`: decode tok/s and TTFT at batch 1..N through the engine, against the HBM roofline
(bytes a decode step reads / measured copy bandwidth), with transformers' eager generate as a peer."""
from __future__ import annotations

import json
import time


def register(bench_sub) -> None:
    p = bench_sub.add_parser("latency", help="decode tok/s, TTFT and %% of the HBM roofline at batch 1..N")
    p.add_argument("--model", default="llama-3.1-8b", help="preset name or model directory (random weights)")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--peer", choices=["none", "transformers"], default="none")
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on", help="on CUDA (the record says what ran)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many GPUs (CPU processes), one rank each")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads on CPU (default: all cores but one, as brrr generate)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\''
                        ": the record adds acceptance, mean accepted length and the formula's predicted speedup")
    p.add_argument("--workload", choices=["random", "edit"], default="random",
                   help="random: random prompt tokens; edit: the prompt is a random passage written twice and its "
                        "start again, the shape of an edit request (the answer restates the prompt)")
    p.add_argument("--out", default=None, help="append the JSON records to this file")
    p.set_defaults(func=cmd_latency)


def require_at_least(**flags: tuple) -> None:
    """flag_name=(value, least): a BrrrError naming the first flag below its least (None: left to its default)."""
    from brrr.errors import BrrrError

    for name, (value, least) in flags.items():
        if value is not None and not value >= least:  # `not >=` also refuses NaN
            raise BrrrError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")


def emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def prompt_ids(gen, vocab: int, prompt_len: int, workload: str) -> list[int]:
    """random: prompt_len random tokens. edit: a random passage, the passage again, then its first quarter (the
    model, or a random one's repetitive output, continues what it has seen: prompt lookup's best case)."""
    import torch

    if workload == "random":
        return torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
    passage = torch.randint(0, vocab, (max(1, prompt_len * 4 // 9),), generator=gen).tolist()
    return (passage * 2 + passage[: len(passage) // 4])[:prompt_len]


def run_batch(engine, batch: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0,
              workload: str = "random"):
    """Returns (ttft_s, decode_s) for `batch` requests of equal shape started together."""
    import torch

    from brrr.engine import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"lat-{seed}-{i}", prompt_ids(gen, vocab, prompt_len, workload), params)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        engine.step()  # the sampler's .tolist() synchronizes, so wall time per step is device time
        first = first or time.perf_counter()
    return first - start, time.perf_counter() - first


def cmd_latency(args) -> int:
    import torch

    from brrr.analysis.hardware import measure
    from brrr.analysis.model import decode_bytes_per_step
    from brrr.bench.random_model import model_config, random_model
    from brrr.cli import cpu_threads
    from brrr.config import EngineConfig
    from brrr.engine import LLMEngine
    from brrr.engine.spec import parse_speculative_config
    from brrr.loader import resolve_dtype

    speculative = parse_speculative_config(args.speculative_config)
    cfg = model_config(args.model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, cfg, device)
    batches = [int(b) for b in args.batch.split(",")]
    gpu = measure() if device.type == "cuda" else None
    threads = None
    if device.type == "cpu":
        threads = cpu_threads(args.cpu_threads)
        torch.set_num_threads(threads)
    # what runs, not what was asked: the runner captures graphs on CUDA only, and never for dynamic NTK RoPE
    tp = args.tensor_parallel_size
    graphs = args.cuda_graphs == "on" and device.type == "cuda" and cfg.rope.type != "dynamic"
    max_len = args.prompt_len + args.new_tokens
    config = EngineConfig(max_model_len=max_len, max_num_seqs=max(batches),
                          num_blocks=max(batches) * -(-max_len // 16) + 8, cuda_graphs=graphs,
                          speculative_config=speculative, tensor_parallel_size=tp)
    if tp > 1:
        from brrr.distributed.tp_runner import load_tensor_parallel

        model, config = load_tensor_parallel(cfg, tp, dtype, device, config)  # random weights, each rank its shard
    else:
        model = random_model(cfg, dtype, device)
    engine = LLMEngine(model, None, config)
    run_batch(engine, 1, args.prompt_len, min(8, args.new_tokens), cfg.vocab_size, seed=99,
              workload=args.workload)  # warm-up
    for batch in batches:
        before = engine.stats()
        ttft, decode_s = run_batch(engine, batch, args.prompt_len, args.new_tokens, cfg.vocab_size, seed=batch,
                                   workload=args.workload)
        tok_s = batch * (args.new_tokens - 1) / decode_s
        record = {"bench": "latency", "model": args.model, "dtype": str(dtype).removeprefix("torch."),
                  "machine": gpu.name if gpu else "cpu", "runner": "brrr", "cuda_graphs": "on" if graphs else "off",
                  "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                  "tensor_parallel_size": tp,
                  "ttft_s": round(ttft, 4), "decode_tok_s": round(tok_s, 1), "workload": args.workload}
        if speculative is not None:
            record.update(spec_record(speculative, before, engine.stats(), batch))
        if threads is not None:
            record["cpu_threads"] = threads
        if gpu:
            # Mean context while decoding; bytes = weights (minus the embedding table) + KV read per step.
            step_bytes = decode_bytes_per_step(cfg, batch, args.prompt_len + args.new_tokens // 2,
                                               str(dtype).removeprefix("torch.").replace("bfloat16", "bf16"))
            roofline = batch * gpu.bandwidth * tp / step_bytes  # each GPU reads its 1/tp of the bytes
            record.update(measured_bandwidth=round(gpu.bandwidth), bytes_per_step=int(step_bytes),
                          roofline_tok_s=round(roofline, 1), fraction_of_roofline=round(tok_s / roofline, 3))
            if tp > 1:  # a decode step all-reduces twice per layer (attention's o_proj, the MLP's down_proj)
                times = engine.runner.time_all_reduce(batch)
                one = times["all_reduce_us_" + times["all_reduce_backend"]]  # what the decode graphs run
                record.update({k: round(v, 2) if isinstance(v, float) else v for k, v in times.items()})
                record.update(all_reduce_us=round(one, 2), all_reduce_us_per_layer=round(2 * one, 2))
        emit(record, args.out)
    if tp > 1:
        engine.runner.shutdown()
    if args.peer == "transformers" and tp == 1:
        peer_transformers(model, cfg, batches, args, gpu)
    return 0


def spec_record(speculative, before: dict, after: dict, batch: int) -> dict:
    """Acceptance over one measured batch (vLLM's definitions): acceptance rate = accepted / draft tokens; mean
    accepted length = tokens per verified run (1 + accepted drafts); alpha fitted to that mean; the formula's
    speedup at that alpha for a proposer of no cost (n-gram: c = 0; a draft model's c is its step-time ratio, which
    `brrr calc spec` takes), to set beside the measured tok/s ratio of a run without --speculative-config."""
    from brrr.analysis.spec_decode import expected_speedup, fit_alpha

    def delta(key):
        return after[key] - before[key]

    k = speculative.num_speculative_tokens
    runs, drafts, accepted = (delta("spec_decode_num_drafts"), delta("spec_decode_num_draft_tokens"),
                              delta("spec_decode_num_accepted_tokens"))
    per_pos = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                     before["spec_decode_num_accepted_tokens_per_pos"])]
    mean_len = 1 + accepted / runs if runs else 1.0
    alpha = fit_alpha(mean_len, k)
    record = {"speculative_config": {k_: v for k_, v in vars(speculative).items() if v is not None},
              "spec_num_drafts": runs, "spec_num_draft_tokens": drafts, "spec_num_accepted_tokens": accepted,
              "acceptance_rate": round(accepted / drafts, 4) if drafts else None,
              "mean_accepted_length": round(mean_len, 3),
              "acceptance_per_pos": [round(a / runs, 4) if runs else None for a in per_pos],
              "alpha_fitted": round(alpha, 4),
              # per sequence per engine step: what the formula's S assumes every step makes; steps without a draft
              # (nothing matched) and the prefill step lower it
              "tokens_per_seq_step": round(delta("generation_tokens") / max(1, delta("num_steps")) / batch, 3),
              # engine steps, those that verified drafts, and those whose forward replayed a verify graph (EAGLE's
              # steps without drafts too: they keep hidden states, which decode graphs do not)
              "engine_steps": delta("num_steps"), "verify_steps": delta("spec_verify_steps"),
              "verify_graph_steps": delta("spec_verify_graph_steps")}
    if "spec_draft_graph_steps" in after:  # a draft model's steps that replayed its own graphs
        record["draft_graph_steps"] = delta("spec_draft_graph_steps")
    if speculative.method == "ngram":
        record["predicted_speedup_c0"] = round(expected_speedup(alpha, k, 0.0), 3)
    return record


def peer_transformers(model, cfg, batches, args, gpu) -> None:
    """transformers' eager generate on the same weights (same names: state dicts load one into the other)."""
    import torch
    import transformers

    from brrr.loader import hf_state_dict

    fields = {k: v for k, v in cfg.to_hf().items() if v is not None}
    hf_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    p = next(model.parameters())
    with torch.device(p.device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=p.dtype).eval()
    hf.load_state_dict(hf_state_dict(model), strict=not cfg.tie_word_embeddings)  # brrr's engine packed q/k/v
    for batch in batches:
        ids = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), device=hf.device)
        gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                   min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            hf.generate(ids, **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            t0 = time.perf_counter()
            hf.generate(ids, **gen)
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        emit({"bench": "latency", "model": args.model, "machine": gpu.name if gpu else "cpu",
              "runner": f"transformers {transformers.__version__} generate (eager)", "batch": batch,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "tok_s_incl_prefill": round(batch * args.new_tokens / (time.perf_counter() - t0), 1)}, args.out)
