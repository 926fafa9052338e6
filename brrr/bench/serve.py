"""`brrr bench serve`: a load generator for any OpenAI-compatible server (brrr serve, vLLM, SGLang, ...).

It builds synthetic prompts (random, or sharing prefixes) from token ids the server's own /tokenize returns,
sends them as streaming requests at a request rate (Poisson arrivals, or gamma with --burstiness) under an
optional concurrency cap, and measures per request: TTFT (send to the first streamed chunk), ITL (gaps between
chunks: one per engine step), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency. It prints
the summary `vllm bench serve` prints, goodput under --goodput SLOs, and with --save-result writes everything
(per-request lists too) as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from brrr.bench.datasets import DATASETS, BenchPrompt, pseudo_text, synthetic_prompts
from brrr.cli import HelpFormatter
from brrr.errors import BrrrError

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
SLO_KEYS = ("ttft", "tpot", "e2el")


def register(bench_sub) -> None:
    p = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server: TTFT, TPOT, ITL, throughput, "
                             "goodput", formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions",
                   help="completions sends token ids (exact input lengths); chat sends text through the template")
    p.add_argument("--model", default=None, help="model name to request (default: the first in GET /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="Bearer token (default: $BRRR_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random: independent prompts; prefix: prompts share --num-prefixes prefixes")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (after the shared prefix, if any)")
    p.add_argument("--output-len", type=int, default=128, help="tokens to generate per request")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix tokens (dataset prefix)")
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct shared prefixes (dataset prefix)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second; inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more even")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--num-warmups", type=int, default=1, help="requests sent (and not counted) before the run")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate exactly --output-len tokens (brrr/vLLM extension field)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el; milliseconds)")
    p.add_argument("--percentiles", default="99", help="comma-separated percentiles to report besides the median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    p.add_argument("--save-result", default=None, metavar="FILE.json", help="write the full result as JSON")
    p.add_argument("--label", default=None, help="free text stored in the JSON result")
    p.set_defaults(func=cmd_bench_serve)


@dataclass
class RequestResult:
    input_len: int = 0
    output_len: int = 0
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # seconds after the run began

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in SLO_KEYS or ms <= 0:
            raise BrrrError(f"--goodput takes KEY:MS with KEY in {', '.join(SLO_KEYS)} and MS > 0, got {item!r}")
        slos[key] = ms
    return slos


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the start): gaps drawn from a gamma with mean 1/rate and shape burstiness."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


# ---- HTTP -----------------------------------------------------------------------------------------------------------
class Client:
    def __init__(self, session, base_url: str, api_key: str | None, timeout: float):
        self.session, self.base_url, self.timeout = session, base_url.rstrip("/"), timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.json_headers = {**self.headers, "Content-Type": "application/json"}

    async def get_json(self, path: str):
        async with self.session.get(self.base_url + path, headers=self.headers) as r:
            return await self._json(r, path)

    async def post_json(self, path: str, body: dict):
        async with self.session.post(self.base_url + path, json=body, headers=self.headers) as r:
            return await self._json(r, path)

    @staticmethod
    async def _json(response, path):
        text = await response.text()
        if response.status != 200:
            raise BrrrError(f"{path}: HTTP {response.status}: {text[:300]}")
        return json.loads(text)

    async def stream(self, endpoint: str, body: bytes, t0: float, result: RequestResult) -> None:
        """POST a streaming request (its JSON body, encoded before the clock), timing every text chunk. Fills
        result (success or error)."""
        import aiohttp

        last, done = None, False
        try:
            async with self.session.post(self.base_url + endpoint, data=body, headers=self.json_headers,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                if r.status != 200:
                    result.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                    return
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = chunk["error"].get("message", str(chunk["error"]))
                        return
                    if chunk.get("usage"):
                        result.output_len = chunk["usage"]["completion_tokens"]
                        result.input_len = chunk["usage"]["prompt_tokens"]
                    if chunk.get("choices"):  # a step's new tokens (their text may still be held back)
                        if last is None:
                            result.ttft = now - t0
                        else:
                            result.itl.append(now - last)
                        last = now
                result.latency = time.perf_counter() - t0
                result.success = done and last is not None
                if not result.success:
                    result.error = "the stream ended before data: [DONE]" if not done else "no choices were streamed"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, json.JSONDecodeError) as e:
            result.error = f"{type(e).__name__}: {e}"


def request_body(endpoint: str, model: str, prompt, output_len: int, ignore_eos: bool) -> bytes:
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == ENDPOINTS["chat"]:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return json.dumps(body).encode()


# ---- the run --------------------------------------------------------------------------------------------------------
async def _token_pool(client: Client, model: str) -> list[int]:
    try:
        tokens = (await client.post_json("/tokenize", {"model": model, "prompt": pseudo_text(3000),
                                                       "add_special_tokens": False}))["tokens"]
    except BrrrError as e:
        raise BrrrError(f"could not build prompts through the server's /tokenize ({e})") from None
    return sorted(set(tokens))


async def run_benchmark(args) -> dict:
    import aiohttp

    slos = parse_goodput(args.goodput)
    percentiles = _percentiles(args.percentiles)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise BrrrError(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise BrrrError("--request-rate and --burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BrrrError("--max-concurrency must be >= 1")
    endpoint = ENDPOINTS[args.endpoint]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        api_key = args.api_key or os.environ.get("BRRR_API_KEY") or os.environ.get("OPENAI_API_KEY")
        client = Client(session, args.base_url, api_key, args.timeout)
        try:
            models = (await client.get_json("/v1/models"))["data"]
        except (aiohttp.ClientError, OSError) as e:
            raise BrrrError(f"cannot reach {args.base_url}: {e}") from None
        model = args.model or models[0]["id"]
        max_len = next((m.get("max_model_len") for m in models if m["id"] == model), None)
        prompts = synthetic_prompts(args.dataset, await _token_pool(client, model), args.num_prompts,
                                    args.input_len, args.output_len, args.range_ratio,
                                    args.prefix_len if args.dataset == "prefix" else 0, args.num_prefixes, args.seed)
        longest = max(p.input_len + p.output_len for p in prompts)
        if max_len and longest > max_len:
            raise BrrrError(f"the longest request needs {longest} tokens (input + output); the server's "
                            f"context is {max_len}: lower --input-len/--output-len/--prefix-len")
        if endpoint == ENDPOINTS["chat"]:
            gate = asyncio.Semaphore(32)

            async def detokenize(ids):
                async with gate:
                    return (await client.post_json("/detokenize", {"model": model, "tokens": ids}))["prompt"]

            payloads = await asyncio.gather(*(detokenize(p.token_ids) for p in prompts))
        else:
            payloads = [p.token_ids for p in prompts]

        for i in range(args.num_warmups):
            warm = RequestResult()
            await client.stream(endpoint, request_body(endpoint, model, payloads[i % len(payloads)],
                                                       min(prompts[0].output_len, 16), args.ignore_eos),
                                time.perf_counter(), warm)
            if not warm.success:
                raise BrrrError(f"warm-up request failed: {warm.error}")

        offsets = arrival_offsets(len(prompts), args.request_rate, args.burstiness, args.seed)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        results = [RequestResult(input_len=p.input_len) for p in prompts]
        bodies = [request_body(endpoint, model, payloads[i], p.output_len, args.ignore_eos)
                  for i, p in enumerate(prompts)]
        start, cpu_start = time.perf_counter(), time.process_time()

        async def one(i: int, prompt: BenchPrompt):
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            body = bodies[i]
            if limit is None:
                t0 = time.perf_counter()
                results[i].start = t0 - start
                return await client.stream(endpoint, body, t0, results[i])
            async with limit:
                t0 = time.perf_counter()
                results[i].start = t0 - start
                await client.stream(endpoint, body, t0, results[i])

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - start
        # the client is one Python process too: near 1.0 it, not the server, may be what limits the rate
        client_cpu = (time.process_time() - cpu_start) / duration
    # start: time.perf_counter() at the first request (CLOCK_MONOTONIC on Linux: comparable with server-side traces)
    return summarize(args, model, results, duration, slos, percentiles) | {"client_cpu_utilization": client_cpu,
                                                                           "start": start}


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = [-1.0]
    if not values or not all(0 < v < 100 for v in values):
        raise BrrrError(f"--percentiles takes numbers in (0, 100), got {text!r}")
    return values


def _quantile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * pct / 100
    low = math.floor(pos)
    high = min(low + 1, len(s) - 1)
    return s[low] + (s[high] - s[low]) * (pos - low)


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    ms = [v * 1000 for v in values_s]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0, f"median_{name}_ms": _quantile(ms, 50),
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = _quantile(ms, p)
    return out


def summarize(args, model: str, results: list[RequestResult], duration: float, slos: dict, percentiles) -> dict:
    ok = [r for r in results if r.success]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    total_in, total_out = sum(r.input_len for r in ok), sum(r.output_len for r in ok)
    good = [r for r in ok if ("ttft" not in slos or r.ttft * 1000 <= slos["ttft"])
            and ("tpot" not in slos or (r.tpot or 0.0) * 1000 <= slos["tpot"])
            and ("e2el" not in slos or r.latency * 1000 <= slos["e2el"])]
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "label": args.label,
        "base_url": args.base_url, "endpoint": ENDPOINTS[args.endpoint], "model": model,
        "dataset": args.dataset, "num_prompts": len(results), "input_len": args.input_len,
        "output_len": args.output_len, "range_ratio": args.range_ratio,
        "prefix_len": args.prefix_len if args.dataset == "prefix" else 0,
        "num_prefixes": args.num_prefixes if args.dataset == "prefix" else 0,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos,
        "num_warmups": args.num_warmups, "seed": args.seed, "client": {"host": platform.node(),
                                                                        "python": platform.python_version()},
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "goodput_slos_ms": slos or None, "request_goodput": len(good) / duration if slos else None,
        "max_concurrent_requests": _peak_concurrency(results),
    }
    result.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    result.update(_stats("tpot", tpots, percentiles))
    result.update(_stats("itl", [g for r in ok for g in r.itl], percentiles))
    result.update(_stats("e2el", [r.latency for r in ok], percentiles))
    result["percentiles"] = percentiles
    result["requests"] = {"input_lens": [r.input_len for r in results], "output_lens": [r.output_len for r in results],
                          "ttfts": [r.ttft for r in results], "latencies": [r.latency for r in results],
                          "itls": [r.itl for r in results], "starts": [r.start for r in results],
                          "errors": [r.error for r in results]}
    return result


def _peak_concurrency(results: list[RequestResult]) -> int:
    events = sorted([(r.start, 1) for r in results if r.latency] + [(r.start + r.latency, -1) for r in results
                                                                     if r.latency])
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def format_summary(result: dict) -> str:
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label, value, fmt="{:.2f}"):
        lines.append(f"{label:<40}{fmt.format(value) if not isinstance(value, str) else value:>10}")

    row("Successful requests:", result["completed"], "{}")
    row("Failed requests:", result["failed"], "{}")
    if result["max_concurrency"]:
        row("Maximum request concurrency:", result["max_concurrency"], "{}")
    row("Request rate configured (RPS):", str(result["request_rate"]))
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "{}")
    row("Total generated tokens:", result["total_output_tokens"], "{}")
    row("Request throughput (req/s):", result["request_throughput"])
    if result["request_goodput"] is not None:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in result["goodput_slos_ms"].items())
        row("Request goodput (req/s):", result["request_goodput"])
        lines.append(f"  (SLOs: {slos})")
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    if "client_cpu_utilization" in result:
        row("Client CPU (busy fraction of a core):", result["client_cpu_utilization"])
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f" {title} ".center(width, "-"))
        name = key.upper()
        row(f"Mean {name} (ms):", result[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", result[f"median_{key}_ms"])
        for p in result["percentiles"]:
            row(f"P{p:g} {name} (ms):", result[f"p{p:g}_{key}_ms"])
    lines.append("=" * width)
    return "\n".join(lines)


def cmd_bench_serve(args) -> int:
    if importlib.util.find_spec("aiohttp") is None:
        raise BrrrError("brrr bench serve needs aiohttp: pip install aiohttp")
    try:  # uvloop, where installed: the client sends a burst of requests about twice as fast
        import uvloop

        result = uvloop.run(run_benchmark(args))
    except ImportError:
        result = asyncio.run(run_benchmark(args))
    print(format_summary(result))
    if result["failed"]:
        first = next(e for e in result["requests"]["errors"] if e)
        print(f"{result['failed']} request(s) failed; the first: {first}", file=sys.stderr)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=1)
        print(f"result written to {args.save_result}", file=sys.stderr)
    return 0 if result["completed"] else 1
