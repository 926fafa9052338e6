"""`brrr bench latency`: decode tok/s and TTFT at batch 1..N through the engine, against the HBM roofline
(bytes a decode step reads / measured copy bandwidth), with transformers' eager generate as a peer."""
from __future__ import annotations

import importlib.util
import json
import sys
import time

from brrr.analysis.cli import DEFAULT_GPU
from brrr.analysis.formats import dtype_format
from brrr.analysis.hardware import get_gpu, measure
from brrr.analysis.model import decode_bytes_per_step, weight_bytes
from brrr.analysis.spec_decode import cost_ratio, expected_speedup, fit_alpha
from brrr.bench.latency_workloads import WORKLOADS, HeldOutText, Workload
from brrr.cli import cpu_threads
from brrr.config import COMPACTING_EVICTIONS, EngineConfig, ModelConfig
from brrr.config.kv_args import add_kv_cache_args, kv_cache_config
from brrr.default_model import default_model_dir
from brrr.engine import LLMEngine
from brrr.engine.spec import parse_speculative_config
from brrr.errors import BrrrError
from brrr.gguf import is_gguf
from brrr.loader import hf_state_dict, load_model, resolve_dtype, weight_files
from brrr.models.random_weights import model_config, random_model
from brrr.sampling_params import SamplingParams
from brrr.tokenizer import Tokenizer


def register(bench_sub) -> None:
    p = bench_sub.add_parser("latency", help="decode tok/s, TTFT and %% of the HBM roofline at batch 1..N")
    p.add_argument("--model", default=None,
                   help="preset name (random weights) or model directory (its weights, random without any); default: "
                        "llama-3.1-8b on a GPU, brrr's shipped default model on a CPU (the 8B shape there takes "
                        "16 GB of RAM and minutes per token)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights even for a model directory that has some (speed only)")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--peer", choices=["none", "transformers"], default="none")
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on", help="on CUDA (the record says what ran)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many GPUs (CPU processes), one rank each")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads on CPU (default: brrr's policy, the free cores but one)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\''
                        ": the record adds acceptance, mean accepted length and the formula's predicted speedup")
    p.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="random: random prompt tokens; code: windows of held-out code (--dataset-path) to complete; "
                        "edit: a passage, a marker, then the passage's start again, so the answer restates the "
                        "prompt (held-out text with --dataset-path, else random tokens)")
    p.add_argument("--dataset-path", default=None,
                   help="held-out text for code/edit: a `brrr data build` directory (its validation split) or a "
                        "text file, tokenized by the model's tokenizer")
    p.add_argument("--num-iters", type=int, default=1,
                   help="runs per batch size, each on new prompts; the record sums them (one batch-1 prompt is "
                        "a noisy sample of acceptance)")
    add_kv_cache_args(p)
    p.add_argument("--out", default=None, help="append the JSON records to this file")
    p.set_defaults(func=cmd_latency)


def require_at_least(**flags: tuple) -> None:
    """flag_name=(value, least): a BrrrError naming the first flag below its least (None: left to its default)."""
    for name, (value, least) in flags.items():
        if value is not None and not value >= least:  # `not >=` also refuses NaN
            raise BrrrError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")


def emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def run_batch(engine, batch: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0):
    """(ttft_s, decode_s) for `batch` random prompts of prompt_len tokens started together."""
    return run_prompts(engine, Workload("random", prompt_len, vocab).prompts(batch, seed), new_tokens, str(seed))


def run_prompts(engine, prompts: list[list[int]], new_tokens: int, tag: str):
    """(ttft_s, decode_s) for the prompts started together as one batch. TTFT ends when every prompt has its first
    token (a batch whose prompts exceed max_num_batched_tokens prefills over several steps); decode_s is the time
    the batch's (new_tokens - 1) tokens a sequence take at the rate measured after that point, so prefill chunks
    never count as decode time while some sequences already decode beside them."""
    import torch

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ids = [f"lat-{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    made: dict[str, int] = {}  # tokens each request has so far
    first = None
    made_at_first = 0
    while engine.has_unfinished_requests():
        for out in engine.step():  # the sampler's .tolist() synchronizes, so wall time per step is device time
            made[out.request_id] = sum(len(c.token_ids) for c in out.outputs)
        if first is None and len(made) == len(ids) and all(made.values()):
            first, made_at_first = time.perf_counter(), sum(made.values())
    end = time.perf_counter()
    first = end if first is None else first
    after = sum(made.values()) - made_at_first
    want = len(ids) * (new_tokens - 1)
    decode_s = (end - first) * want / after if after else end - first
    return first - start, decode_s


def default_model(device_type: str) -> str:
    """The 8B shape on a GPU (the reference point in bench/results); on a CPU the shipped default model, which
    decodes there in milliseconds (the 8B shape's random weights would take 16 GB and minutes per token)."""
    if device_type == "cuda":
        return "llama-3.1-8b"
    print("brrr bench latency: on a CPU the default is brrr's shipped default model; pass --model for another",
          file=sys.stderr)
    return str(default_model_dir())


def weights_dir(spec: str, load_format: str):
    """The model directory whose weights to load, or None for random weights (a preset, --load-format dummy, or a
    directory of a config alone)."""
    from pathlib import Path

    if load_format != "dummy" and is_gguf(spec):  # a GGUF file holds its weights
        return Path(spec)
    if load_format == "dummy" or not Path(spec).is_dir():
        return None
    try:
        weight_files(Path(spec))
    except BrrrError:
        return None  # a config.json alone: its shape with random weights, as before
    return Path(spec)


def text_tokenizer(model_dir, dataset_path: str):
    """The model's tokenizer; for a preset, a data build's own (its ids must fit the model's vocabulary)."""
    from pathlib import Path

    for where in (model_dir, dataset_path):
        if where is not None and ((Path(where) / "tokenizer.json").is_file() or is_gguf(where)):
            return Tokenizer.from_dir(where)
    raise BrrrError("--dataset-path needs a tokenizer to encode its text: a --model directory with tokenizer.json, "
                    "or a `brrr data build` directory as --dataset-path")


def make_workload(args, cfg):
    from pathlib import Path

    text = None
    if args.dataset_path is not None:
        if args.workload == "random":
            raise BrrrError("--dataset-path is for --workload code or edit (random prompts read no text)")
        model_dir = args.model if Path(args.model).is_dir() or is_gguf(args.model) else None
        text = HeldOutText(args.dataset_path, text_tokenizer(model_dir, args.dataset_path))
    return Workload(args.workload, args.prompt_len, cfg.vocab_size, text)


def kept_context(args) -> int:
    """The mean number of cached tokens a decode step reads per sequence: the whole context, or what the eviction
    policy keeps of it (snapkv: the compacted prompt plus every generated token; streaming/h2o: at most the budget)."""
    context = args.prompt_len + args.new_tokens // 2
    if args.kv_eviction is None or args.kv_budget is None:
        return context
    if args.kv_eviction == "snapkv":
        return min(args.prompt_len, args.kv_budget) + args.new_tokens // 2
    return min(context, args.kv_budget)


def cmd_latency(args) -> int:
    import torch

    require_at_least(prompt_len=(args.prompt_len, 1), new_tokens=(args.new_tokens, 2),
                     num_iters=(args.num_iters, 1))
    if args.peer == "transformers" and importlib.util.find_spec("transformers") is None:
        raise BrrrError("--peer transformers needs transformers installed (pip install transformers); it is "
                        "checked before brrr's half runs")
    speculative = parse_speculative_config(args.speculative_config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.model = args.model or default_model(device.type)
    cfg = model_config(args.model)
    source = weights_dir(args.model, args.load_format)
    workload = make_workload(args, cfg)
    if device.type == "cpu" and source is None:
        gb = weight_bytes(cfg, dtype_format(resolve_dtype(args.dtype, cfg, device))) / 1e9
        if gb > 2:
            print(f"brrr bench latency: {args.model} on a CPU takes {gb:.1f} GB of random weights and about as "
                  "many bytes per decoded token; this is a plumbing check, not a measurement", file=sys.stderr)
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
    blocks = -(-max_len // 16)
    if speculative is not None:  # a verify step writes k draft slots past the sequence: room for them too
        blocks += -(-(speculative.num_speculative_tokens + 1) // 16)
    config = EngineConfig(max_model_len=max_len, max_num_seqs=max(batches), num_blocks=max(batches) * blocks + 8,
                          cuda_graphs=graphs, speculative_config=speculative, tensor_parallel_size=tp,
                          **kv_cache_config(args),
                          # the policies that rewrite blocks in place need prefix caching off
                          enable_prefix_caching=args.kv_eviction not in COMPACTING_EVICTIONS)
    if tp > 1:
        from brrr.distributed.tp_loader import load_tensor_parallel  # TP only: torch.distributed and workers

        # each rank loads its own shard (of random weights when there are none to load)
        model, config = load_tensor_parallel(source or cfg, tp, dtype, device, config)
    else:
        model = load_model(source, dtype, device) if source else random_model(cfg, dtype, device)
    engine = LLMEngine(model, None, config)
    for batch in batches:
        # an untimed run at this batch first: the kernels its shapes need (a proposer's first call over every
        # prompt, the prefill of the whole batch) compile here, not inside the first timed iteration
        run_prompts(engine, workload.prompts(batch, 10**6 + batch), min(8, args.new_tokens), f"warm-up-{batch}")
        before = engine.stats()
        ttft = decode_s = 0.0
        for it in range(args.num_iters):
            seed = batch + 1000 * it
            first, rest = run_prompts(engine, workload.prompts(batch, seed), args.new_tokens, str(seed))
            ttft, decode_s = ttft + first / args.num_iters, decode_s + rest
        tok_s = args.num_iters * batch * (args.new_tokens - 1) / decode_s
        record = {"bench": "latency", "model": args.model, "weights": "loaded" if source else "random",
                  "dtype": str(dtype).removeprefix("torch."),
                  "machine": gpu.name if gpu else "cpu", "runner": "brrr", "cuda_graphs": "on" if graphs else "off",
                  "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                  "num_iters": args.num_iters, "tensor_parallel_size": tp,
                  "ttft_s": round(ttft, 4), "decode_tok_s": round(tok_s, 1), "workload": args.workload,
                  "workload_source": workload.source, "kv_cache_dtype": args.kv_cache_dtype,
                  "kv_eviction": args.kv_eviction, "kv_budget": args.kv_budget}
        if speculative is not None:
            record.update(spec_record(speculative, before, engine.stats(), batch))
            if record["spec_num_drafts"]:  # none: speculation was off (disable_by_batch_size) or found nothing
                record.update(spec_prediction(speculative, cfg, gpu, batch, args.prompt_len + args.new_tokens // 2,
                                              dtype, record["mean_accepted_length"]))
        if threads is not None:
            record["cpu_threads"] = threads
        if gpu:
            # Mean context while decoding; bytes = weights (minus the embedding table) + KV read per step.
            step_bytes = decode_bytes_per_step(cfg, batch, kept_context(args), dtype_format(dtype),
                                               dtype_format(dtype) if args.kv_cache_dtype == "auto" else args.kv_cache_dtype)
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


def spec_prediction(speculative, cfg, gpu, batch: int, context: int, dtype, mean_len: float) -> dict:
    """`brrr calc spec`'s S = E / (1 + k c) with the measured E (the mean accepted length) and c on the roofline of
    this GPU (measured; on CPU calc's default datasheet GPU): 0 for n-gram, the draft's decode step over the
    target's, or the EAGLE head's (one target layer, fc and the LM head). Launch overheads, which dominate a small
    model's steps, are not in c: the measured ratio falls short of S where they do."""
    gpu = gpu or get_gpu(DEFAULT_GPU)
    k = speculative.num_speculative_tokens
    if speculative.method == "ngram":
        c = 0.0
    else:
        draft = None if speculative.method == "eagle" else ModelConfig.from_dir(speculative.model)
        c = cost_ratio(cfg, draft, gpu, batch, context, dtype_format(dtype))["cost_ratio"]
    return {"cost_ratio_roofline": round(c, 4), "cost_ratio_gpu": gpu.name,
            "predicted_speedup": round(mean_len / (1 + k * c), 3)}


def spec_record(speculative, before: dict, after: dict, batch: int) -> dict:
    """Acceptance over one measured batch (vLLM's definitions): acceptance rate = accepted / draft tokens; mean
    accepted length = tokens per verified run (1 + accepted drafts); alpha fitted to that mean; the formula's
    speedup at that alpha for a proposer of no cost (n-gram: c = 0; a draft model's c is its step-time ratio, which
    `brrr calc spec` takes), to set beside the measured tok/s ratio of a run without --speculative-config."""
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
    if "spec_draft_graph_steps" in after:  # a draft model's steps, or an EAGLE head's proposals, that replayed graphs
        record["draft_graph_steps"] = delta("spec_draft_graph_steps")
    if speculative.method == "ngram":
        record["predicted_speedup_c0"] = round(expected_speedup(alpha, k, 0.0), 3)
    return record


def peer_transformers(model, cfg, batches, args, gpu) -> None:
    """transformers' eager generate on the same weights (same names: state dicts load one into the other)."""
    import torch
    import transformers

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
