"""`brrr serve`: the OpenAI-compatible server on uvicorn.

brrr/cli.py wires it through `register(subparsers)`. SIGTERM / Ctrl-C: uvicorn stops accepting connections, lets
in-flight requests finish for up to --shutdown-timeout seconds, cancels what is left (which aborts those engine
requests), then the engine thread stops and the process exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from brrr.cli import add_model_args
from brrr.errors import BrrrError


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-access-log", action="store_true", help="don't log one line per HTTP request")
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None, help="context cap (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV-cache size (default: 256 MiB on CPU; on CUDA what --gpu-memory-utilization leaves)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn off prefix caching")
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads when serving on CPU (default: all cores but one, which the HTTP side gets)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    try:
        import uvicorn
    except ImportError:
        raise BrrrError("brrr serve needs fastapi, uvicorn, pydantic and prometheus-client: "
                        "pip install fastapi uvicorn pydantic prometheus-client") from None
    from brrr.config import EngineConfig
    from brrr.engine import AsyncLLM, LLMEngine
    from brrr.pretrained import load
    from brrr.server.app import create_app

    for name, low in (("port", 0), ("max_waiting", 0), ("max_body_bytes", 1), ("shutdown_timeout", 0),
                      ("cpu_threads", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise BrrrError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching,
                          max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None)
    pretrained = load(args.model, dtype=args.dtype, device=args.device)
    if next(pretrained.model.parameters()).device.type == "cpu":
        import torch

        torch.set_num_threads(args.cpu_threads or max(1, torch.get_num_threads() - 1))
    engine = LLMEngine(pretrained.model, pretrained.tokenizer, config, pretrained.eos_token_ids)
    name = args.served_model_name or args.model or "brrr-default"
    llm = AsyncLLM(engine)
    api_key = args.api_key or os.environ.get("BRRR_API_KEY") or None
    app = create_app(llm, pretrained.tokenizer, name, model_path=pretrained.path, api_key=api_key,
                     max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes)
    device = next(pretrained.model.parameters()).device
    note = "" if args.model else " (brrr's small default model: it completes Python and is not chat-tuned)"
    print(f"brrr serve: {name!r} from {pretrained.path} on {device}{note}; {engine.block_manager.num_blocks} KV "
          f"blocks of {config.block_size} tokens, context {engine.max_model_len}; "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                          access_log=not args.no_access_log,
                                          timeout_graceful_shutdown=args.shutdown_timeout))
    # uvicorn handles SIGTERM while it runs (drain, then stop) and re-raises it afterwards; by then it is dealt with,
    # so a no-op handler lets the engine shut down and the process exit 0 instead of dying by the signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        llm.shutdown()
    return 0 if server.started else 1
