"""The `brrr` command. Each subcommand registers its own parser; user errors exit 2 with a one-line message."""
from __future__ import annotations

import argparse
import re
import sys
import time

from brrr import __version__
from brrr.engine import LLM
from brrr.errors import BrrrError
from brrr.threads import cpu_threads as _cpu_threads
from brrr.threads import use_cpu_threads
from brrr.sampling_params import SamplingParams

DESCRIPTION = """serve, shrink, train and measure LLMs.

Without --model, commands use brrr's shipped default model: a small (7.2M-parameter, 14 MB) Llama-architecture
model that brrr trained on Python source; it completes Python code, plausibly but not reliably, and it
is not chat-tuned. Point --model at a Hugging Face model directory (or hub id, when online) for anything else."""

DEFAULT_MODEL_NOTE = "brrr's small default model completes Python and is not chat-tuned"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each default said once: argparse's "(default: X)" is added only where the help text does not
    state the default itself and there is a value to show (a None default means "see the text", not "None")."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None, help="HF model directory or hub id (default: brrr's shipped Python-code model)")
    p.add_argument("--dtype", default="auto", help="auto (checkpoint dtype on GPU, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")


def add_sampling_args(p: argparse.ArgumentParser, temperature: float):
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads on CPU (default: the free cores but one, brrr's policy: docs/serving.md)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def sampling_params(args):
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    except BrrrError as e:  # "top_p must be ..." -> "--top-p must be ...": the flag the user typed
        raise BrrrError(re.sub(r"^[a-z_]+", lambda m: "--" + m.group(0).replace("_", "-"), str(e))) from None


def _load_llm(args):
    import torch

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    if next(llm.pretrained.model.parameters()).device.type == "cpu":
        torch.set_num_threads(cpu_threads(args.cpu_threads))
    return llm, time.perf_counter() - t0


def cpu_threads(requested: int | None) -> int:
    """Torch threads on CPU: brrr's one policy (brrr/threads.py), which every entry point follows."""
    return _cpu_threads(requested)


def _stream(llm, prompt, params, lead: str = ""):
    """Run one request through the engine, writing `lead` (once the request is accepted: a refusal is the only
    output) and then the text to stdout as it is produced. Returns the final output."""
    engine, request_id = llm.engine, f"cli-{time.monotonic_ns()}"
    engine.add_request(request_id, prompt, params)
    sys.stdout.write(lead)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            final = out
    return final


def cmd_generate(args) -> int:
    import json
    from pathlib import Path

    from rich.console import Console

    params = sampling_params(args)
    console = Console(stderr=True, soft_wrap=True)
    prompt_file = Path(args.prompt)
    llm, load_s = _load_llm(args)
    device = next(llm.pretrained.model.parameters()).device
    start = time.perf_counter()
    if prompt_file.is_file():  # a file of prompts, one per line: the whole batch through the engine
        lines = [(number, line) for number, line in enumerate(prompt_file.read_text().splitlines(), 1)
                 if line.strip()]
        if not lines:
            raise BrrrError(f"{prompt_file} has no prompts (one per line)")
        for number, line in lines:  # fail before generating anything, naming the line to fix
            try:
                llm.engine.make_request(f"line-{number}", line, params)
            except BrrrError as e:
                raise BrrrError(f"{prompt_file} line {number}: {e}") from None
        prompts = [line for _, line in lines]
        outputs = llm.generate(prompts, params)
        for out in outputs:
            c = out.outputs[0]
            print(json.dumps({"prompt": out.prompt, "text": c.text, "finish_reason": c.finish_reason,
                              "output_tokens": len(c.token_ids)}))
        n, requests = sum(len(o.outputs[0].token_ids) for o in outputs), len(outputs)
    else:
        n, requests = len(_stream(llm, args.prompt, params, lead=args.prompt).outputs[0].token_ids), 1
        sys.stdout.write("\n")
    seconds = time.perf_counter() - start
    stats = llm.engine.stats()
    console.print(f"[dim]{requests} request(s), {n} tokens in {seconds:.2f} s ({n / seconds:.1f} tok/s); "
                  f"{stats['num_steps']} engine steps, {stats['num_preemptions']} preemptions; model "
                  f"{llm.pretrained.path.name} loaded in {load_s:.2f} s on {device}[/dim]")
    return 0


def cmd_chat(args) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    params = sampling_params(args)
    llm, _ = _load_llm(args)
    tokenizer = llm.tokenizer
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.model is None:
        console.print(f"[yellow]warning: {DEFAULT_MODEL_NOTE}; its replies are not answers. Pass --model with a "
                      "chat (instruct) model to chat.[/yellow]")
    console.print(f"[dim]chatting with {llm.pretrained.path} - /reset clears the history, /exit or Ctrl-D quits[/dim]")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _stream(llm, tokenizer.encode_chat(messages), params, lead="assistant> ").outputs[0].text
        except BrrrError as e:  # e.g. the history outgrew the context: this turn is dropped, the chat goes on
            messages.pop()
            console.print(f"[red]error: {e}[/red] (/reset clears the history)")
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="brrr", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"brrr {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("generate", help="complete a prompt (streamed), or every line of a prompts file (batched)")
    p.add_argument("prompt", help="the prompt text, or a file with one prompt per line")
    add_model_args(p)
    add_sampling_args(p, temperature=0.8)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat through the model's chat template")
    add_model_args(p)
    add_sampling_args(p, temperature=0.8)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat)

    for register in _plugins():
        register(sub)
    return parser


def _plugins():
    """Subcommands that live with their feature (brrr/<feature>/cli.py), present once that feature lands."""
    import importlib

    for module in ("brrr.analysis.cli", "brrr.train.cli", "brrr.server.cli", "brrr.bench.cli", "brrr.quant.cli",
                   "brrr.gguf.cli", "brrr.prune.cli"):
        try:
            yield importlib.import_module(module).register
        except ModuleNotFoundError as e:
            if not (e.name and module.startswith(e.name)):
                raise


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        use_cpu_threads(getattr(args, "cpu_threads", None))  # every subcommand, train and finetune too
        return args.func(args)
    except BrrrError as e:
        print(f"brrr: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("brrr: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
