"""`verispec serve --ray` figures for docs/benchmarks.md ("Ray Serve (issue 26)"), on loopback only.

    python scripts/bench_ray.py routing      # prefix-cache hit rate of a multi-turn chat workload:
                                             # prefix-aware router vs Ray's default, 2 replicas x 1 CPU
    python scripts/bench_ray.py ttft         # time to first token, 1 replica through Ray vs the plain
                                             # server (both up, requests alternating)
    python scripts/bench_ray.py throughput   # scripts/loadtest.py's mixed workload against
                                             # 2 replicas x 1 thread, 1 replica x 2 threads (both Ray)
                                             # and the plain server x 2 threads, interleaved in rounds

``routing``: ``--conversations`` chats run at once, each ``--turns`` turns long (a turn sends
the whole history plus a new user message); the hit rate is the share of prompt tokens whose
K/V came from a replica's prefix cache (``cached_tokens`` / ``prompt_tokens`` summed over the
responses). The same conversations run under each router on a fresh deployment (cold caches).

``throughput``: all setups are started at once (an idle server costs no CPU); each round
then runs one loadtest cell (``scripts/loadtest.py``'s mixed workload: greedy, logprobs,
n = 2, penalties) against each setup in turn, so load from other jobs on the machine hits
every setup alike; round 0 warms up and is left out; ratios are reported per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # loadtest.py: its server start/stop and its load
USER_TURNS = ["Tell me about {topic}.", "Why does that matter?", "Give an example.", "Summarize it in one line.",
              "What is a common mistake?", "And how do I avoid it?"]
TOPICS = ["rivers", "volcanoes", "bread", "bees", "clocks", "bridges", "tides", "maps", "glass", "kites",
          "salt", "comets", "owls", "deserts", "paper", "wind", "coral", "trains", "ink", "moss", "lighthouses",
          "caves", "copper", "fog"]


# ----------------------------------------------------------------------------- routing


def conversation(url: str, model: str, topic: str, turns: int, max_tokens: int, out: list[dict]) -> None:
    """One chat of ``turns`` turns (each sends the whole history); a record per turn."""
    messages = [{"role": "system", "content": "You are a concise, friendly assistant who answers in two sentences."}]
    for t in range(turns):
        messages.append({"role": "user", "content": USER_TURNS[t % len(USER_TURNS)].format(topic=topic)})
        r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        body = r.json()
        stats = body["verispec"]
        out.append({"topic": topic, "turn": t, "replica": stats["replica"], "prompt_tokens": stats["prompt_tokens"],
                    "cached_tokens": stats["cached_tokens"]})
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})


def run_workload(url: str, args: argparse.Namespace) -> list[dict]:
    out: list[dict] = []
    if args.conversations > len(TOPICS):
        raise SystemExit(f"at most {len(TOPICS)} conversations (one topic each)")
    threads = [threading.Thread(target=conversation, args=(url, args.model, TOPICS[i], args.turns,
                                                           args.max_tokens, out))
               for i in range(args.conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def routing(args: argparse.Namespace) -> None:
    import ray
    from ray import serve

    from verispec.server.state import ServerConfig
    from verispec.server.ray_serve import (
        APP_NAME,
        QUIET,
        RayConfig,
        build_app,
        no_usage_stats,
    )

    no_usage_stats()
    ray.init(num_cpus=2, logging_level="ERROR", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port}, logging_config=QUIET)
    url = f"http://127.0.0.1:{args.port}"
    server = ServerConfig(model=args.model, max_batch=8, max_model_len=2048)
    setups = [("prefix-aware router, 2 replicas", RayConfig(server, replicas=2)),
              ("Ray's default router (power of two), 2 replicas", RayConfig(server, replicas=2, prefix_routing=False)),
              ("one replica (every turn finds its prefix: the bound)", RayConfig(server, replicas=1))]
    rows = []
    try:
        for name, config in setups:
            serve.run(build_app(config), name=APP_NAME, route_prefix="/", logging_config=QUIET)
            t0 = time.perf_counter()
            recs = run_workload(url, args)
            wall = time.perf_counter() - t0
            serve.delete(APP_NAME)
            later = [r for r in recs if r["turn"] > 0]
            sticky = sum(len({r["replica"] for r in recs if r["topic"] == t}) == 1 for t in {r["topic"] for r in recs})
            rows.append({"setup": name, "requests": len(recs),
                         "hit_rate": sum(r["cached_tokens"] for r in recs) / sum(r["prompt_tokens"] for r in recs),
                         "hit_rate_later_turns": (sum(r["cached_tokens"] for r in later)
                                                  / max(1, sum(r["prompt_tokens"] for r in later))),
                         "conversations_on_one_replica": f"{sticky}/{args.conversations}", "wall_s": round(wall, 1)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print("| setup | requests | hit rate (all turns) | hit rate (turns 2+) | conversations on one replica | wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setup']} | {r['requests']} | {r['hit_rate']:.1%} | {r['hit_rate_later_turns']:.1%} | "
              f"{r['conversations_on_one_replica']} | {r['wall_s']} |")
    print(f"\nmodel {args.model}, {args.conversations} conversations x {args.turns} turns at once, max_tokens "
          f"{args.max_tokens}, load average at end {os.getloadavg()[0]:.1f}")


# ----------------------------------------------------------------------------- throughput


SETUPS = {  # name -> (extra server arguments, threads per replica, share of the clients it gets)
    "ray 2x1": (["--ray", "--replicas", "2"], 1, 1.0),
    "ray 1x2": (["--ray", "--replicas", "1"], 2, 1.0),
    "plain x2": ([], 2, 1.0),
    "plain x1, half the clients": ([], 1, 0.5),  # one replica's share of 2x1: the model's input
}


def start(args: argparse.Namespace, setup: str, clients: int) -> tuple[subprocess.Popen, str]:
    """``loadtest.start_server`` with this setup's arguments (same limits as a loadtest run)."""
    import loadtest

    extra, threads, _ = SETUPS[setup]
    return loadtest.start_server(argparse.Namespace(
        model=args.model, concurrency=[clients], threads=threads, max_prompt_tokens=320, max_tokens=args.max_tokens,
        server_arg=extra, api_key=None))


def throughput(args: argparse.Namespace) -> None:
    """Every setup up at once (an idle server costs no CPU), then rounds of one loadtest cell
    per setup; round 0 warms up and is left out."""
    import asyncio

    import loadtest

    prompts = loadtest.load_prompts(args.model, 4 * args.clients, 320)
    mix = ("greedy", "logprobs", "n2", "penalties")
    servers = {name: start(args, name, max(1, round(args.clients * share)))
               for name, (_, _, share) in SETUPS.items()}
    results: dict[str, list[dict]] = {name: [] for name in SETUPS}
    try:
        for rnd in range(args.rounds + 1):
            for name, (_, url) in servers.items():
                clients = max(1, round(args.clients * SETUPS[name][2]))
                before = loadtest.scrape(url)
                recs, wall = asyncio.run(loadtest.run_cell(url, args.model, prompts, clients, 3 * clients,
                                                           "prompt-lookup", args.max_tokens, 600, None, None, mix))
                row = loadtest.summarize(recs, wall, before, loadtest.scrape(url))
                res = {"round": rnd, "clients": clients, "tok_s": row["tok_s"], "ttft_p50": row["ttft_p50"],
                       "failed": row["failed"], "load": os.getloadavg()[0]}
                print(json.dumps({"setup": name} | res), file=sys.stderr, flush=True)
                if rnd:
                    results[name].append(res)
    finally:
        for proc, _ in servers.values():
            loadtest.stop_server(proc)
    print("| setup | clients | aggregate tok/s per round | TTFT p50 s per round | failed |")
    print("|---|---:|---|---|---:|")
    for name, rs in results.items():
        tok = " / ".join(f"{r['tok_s']:.1f}" for r in rs)
        first = " / ".join(f"{r['ttft_p50']:.3f}" for r in rs)
        print(f"| {name} | {rs[0]['clients']} | {tok} | {first} | {sum(r['failed'] for r in rs)} |")
    tput = [a["tok_s"] / b["tok_s"] for a, b in zip(results["ray 2x1"], results["ray 1x2"])]
    model = [a["tok_s"] / (2 * b["tok_s"]) for a, b in zip(results["ray 2x1"], results["plain x1, half the clients"])]
    ray = [a["tok_s"] / b["tok_s"] for a, b in zip(results["ray 1x2"], results["plain x2"])]
    print(f"\nthroughput 2x1 / 1x2 per round: {[round(x, 3) for x in tput]}, median {statistics.median(tput):.3f}")
    print(f"2x1 / (2 x one 1-thread plain server at half the clients) per round: {[round(x, 3) for x in model]}")
    print(f"ray 1x2 / plain x2 per round: {[round(x, 3) for x in ray]}")
    print(f"model {args.model}, {args.clients} clients, max_tokens {args.max_tokens}, mix {','.join(mix)}, "
          f"load averages {[round(r['load'], 1) for rs in results.values() for r in rs]}")


def first_token_s(url: str, model: str, prompt: str) -> float:
    """Seconds from sending a streaming chat request to its first content chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", "") and '"content":""' not in line:
                return time.perf_counter() - t0
    raise RuntimeError(f"no token from {url}")


def ttft(args: argparse.Namespace) -> None:
    """Both servers up at once, requests alternating between them (one at a time)."""
    import loadtest

    servers = {name: start(args, name, 4) for name in ("plain x2", "ray 1x2")}
    times: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for i in range(args.requests + 4):
            for name, (_, url) in (servers.items() if i % 2 == 0 else reversed(servers.items())):
                t = first_token_s(url, args.model, f"Say hello to {TOPICS[i % len(TOPICS)]}.")
                if i >= 4:  # warm-up
                    times[name].append(t)
    finally:
        for proc, _ in servers.values():
            loadtest.stop_server(proc)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    diffs = [r - p for r, p in zip(times["ray 1x2"], times["plain x2"])]
    print("| server | TTFT p50 ms | p90 ms |\n|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {med[name] * 1e3:.1f} | {sorted(ts)[int(0.9 * len(ts))] * 1e3:.1f} |")
    print(f"\nRay overhead per request (paired, median of ray - plain): {statistics.median(diffs) * 1e3:.1f} ms over "
          f"{len(diffs)} pairs; model {args.model}, load average at end {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("routing", "throughput", "ttft"))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=40, help="ttft: requests per server")
    args = ap.parse_args()
    {"routing": routing, "throughput": throughput, "ttft": ttft}[args.what](args)


if __name__ == "__main__":
    main()
