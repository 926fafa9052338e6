"""`brrr serve`: the OpenAI-compatible server on uvicorn.

brrr/cli.py wires it through `register(subparsers)`. The engine runs in a process of its own (engine_process.py),
which loads the model and warms up before the server listens. SIGTERM / Ctrl-C: uvicorn stops accepting
connections, lets in-flight requests finish for up to --shutdown-timeout seconds, cancels what is left (which aborts
those engine requests), then the engine process stops and the server exits 0 (1 if the engine process had died).
"""
from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import socket
import sys

from brrr.cli import DEFAULT_MODEL_NOTE, HelpFormatter, add_model_args
from brrr.config.kv_args import add_kv_cache_args, kv_cache_config
from brrr.errors import BrrrError


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
                       formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients put in 'model' (default: --model as given, or 'brrr-default')")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $BRRR_API_KEY; unset = no auth)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="answer 429 once this many admitted requests are still waiting for their first token "
                        "(default: no cap)")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="larger request bodies get 413")
    p.add_argument("--shutdown-timeout", type=int, default=30,
                   help="on SIGTERM, seconds to let in-flight requests finish before cancelling them")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how the model writes tool calls (default: read from the chat template): hermes for "
                        "Hermes/Qwen <tool_call> blocks, llama3_json for Llama 3's JSON calls")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default when a request has tools): read tool calls out of the '
                        'model\'s free reply; "required", a named function and "none" work without it')
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-access-log", action="store_true", help="don't log one line per HTTP request")
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None, help="context cap (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many GPUs, one worker process each (vLLM's flag)")
    g.add_argument("--disaggregate", default=None, metavar="prefill=IDS,decode=ID",
                   help="prefill and decode on separate GPUs (DistServe): e.g. prefill=0,decode=1; each prefill "
                        "instance gets its own process and model copy and sends each prompt's KV blocks to the "
                        "decode instance (on CPU the ids name process slots; docs/tensor-parallel.md)")
    g.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV-cache size (default: 256 MiB on CPU; on CUDA what --gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn off prefix caching")
    g.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant kernels: a request's logprobs do not depend on what shares its batch "
                        "(docs/batch-invariance.md)")
    add_kv_cache_args(g)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(docs/speculative.md)")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads when serving on CPU (default: all cores but one, which the HTTP side gets)")
    g.add_argument("--engine-in-thread", action="store_true",
                   help="run the engine in a thread of the server process instead of a process of its own "
                        "(slower under load: both share one GIL; for comparison and debugging)")
    lora = p.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters: 'model' in a request names one (implied by --lora-modules)")
    lora.add_argument("--enable-runtime-lora", action="store_true",
                      help="let clients load and unload adapters at run time (/v1/load_lora_adapter and "
                           "/v1/unload_lora_adapter read any path the server can, unless --lora-dirs limits them)")
    lora.add_argument("--lora-dirs", nargs="+", default=None, metavar="DIR",
                      help="with --enable-runtime-lora: load adapters only from inside these directories")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=DIR",
                      help='adapters (PEFT directories) served from the start, as name=DIR or JSON '
                           '{"name": ..., "path": ...}')
    lora.add_argument("--max-loras", type=int, default=1, help="adapters one engine step may mix (device slots)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="loaded adapters kept in host memory (default: --max-loras)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    try:
        import uvicorn
    except ImportError:
        raise BrrrError("brrr serve needs fastapi, uvicorn, pydantic and prometheus-client: "
                        "pip install fastapi uvicorn pydantic prometheus-client") from None
    from brrr.config import EngineConfig
    from brrr.engine.engine_process import EngineSpec
    from brrr.engine.spec import parse_speculative_config
    from brrr.hub import resolve_model
    from brrr.pretrained import check_device

    for name, low in (("port", 0), ("max_waiting", 0), ("max_body_bytes", 1), ("shutdown_timeout", 0),
                      ("cpu_threads", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise BrrrError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    check_device(args.device)
    from brrr.server.lora_adapters import parse_lora_modules

    lora_modules = parse_lora_modules(args.lora_modules)
    if args.lora_dirs and not args.enable_runtime_lora:
        raise BrrrError("--lora-dirs limits runtime adapter loading, which is off: add --enable-runtime-lora")
    check_port(args.host, args.port)  # before minutes of loading: a busy port fails now
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching,
                          max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None,
                          enable_lora=args.enable_lora or args.enable_runtime_lora or bool(lora_modules),
                          max_loras=args.max_loras,
                          max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                          speculative_config=parse_speculative_config(args.speculative_config),
                          tensor_parallel_size=args.tensor_parallel_size, disaggregate=args.disaggregate,
                          batch_invariant=args.batch_invariant, **kv_cache_config(args))
    if config.disaggregate is not None:  # the GPUs named exist: before the engine process starts loading
        from brrr.config.disaggregation import check_devices

        check_devices(config.disaggregate, check_device(args.device))
    spec = EngineSpec(str(resolve_model(args.model)), args.dtype, args.device, config, args.cpu_threads,
                      log_level=args.log_level)
    llm = _start_engine(spec, in_thread=args.engine_in_thread)
    try:
        from brrr.server.app import create_app

        name = args.served_model_name or args.model or "brrr-default"
        api_key = args.api_key or os.environ.get("BRRR_API_KEY") or None
        app = create_app(llm, llm.tokenizer, name, model_path=spec.model, api_key=api_key,
                         max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                         tool_call_parser=args.tool_call_parser,
                         enable_auto_tool_choice=args.enable_auto_tool_choice, lora_modules=lora_modules,
                         runtime_lora=args.enable_runtime_lora, lora_dirs=args.lora_dirs)
        info = llm.info
        where = "in a thread" if args.engine_in_thread else f"in process {info.pid}"
        if config.disaggregate is not None:
            where += f", prefill instances on {', '.join(map(str, config.disaggregate.prefill))}"
        note = "" if args.model else f" ({DEFAULT_MODEL_NOTE})"
        print(f"brrr serve: {name!r} from {spec.model} on {info.device} ({where}){note}; {info.num_blocks} KV "
              f"blocks of {info.block_size} tokens, context {info.max_model_len}; warm-up "
              f"{info.warm_up_seconds:.1f} s; http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                              access_log=not args.no_access_log,
                                              timeout_graceful_shutdown=args.shutdown_timeout))
        # uvicorn handles SIGTERM while it runs (drain, then stop) and re-raises it afterwards; by then it is dealt
        # with, so a no-op handler lets the engine shut down and the process exit 0 instead of dying by the signal.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        gc.collect()  # start-up's objects live as long as the server: keep full collections from walking them
        gc.freeze()
        try:
            server.run()
        finally:
            signal.signal(signal.SIGTERM, previous)
            # frozen objects are never collected, not even at exit, where Triton's bindings then report each
            # of theirs as leaked
            gc.unfreeze()
    finally:
        failure = llm.failure  # read before shutdown: a server whose engine died must not exit as if all went well
        llm.shutdown()
    if failure is not None:
        print(f"brrr serve: exiting with status 1: the engine failed while serving: {failure}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def check_port(host: str, port: int) -> None:
    """Fail now if host:port cannot be bound (in use, or not an address of this machine). uvicorn binds again
    later; SO_REUSEADDR, as uvicorn sets it, so a port in TIME_WAIT is not reported busy."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise BrrrError(f"cannot listen on {host}:{port}: {why}; pick another --port (or --host)") from None


def _start_engine(spec, in_thread: bool):
    from brrr.engine import AsyncLLM

    if not in_thread:
        return AsyncLLM.spawn(spec)
    from brrr.engine.engine_process import engine_for

    return AsyncLLM(engine_for(spec))
