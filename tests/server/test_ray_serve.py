"""``verispec serve --ray`` (issue 26): replicas on a local Ray instance (``ray.init(num_cpus=2)``)
behind one OpenAI endpoint, against the single-process server. The Ray tests are marked
``ray`` (``make test-ray``, run by .ci/run after the other groups); the routing-table tests
need no Ray and run in the default suite.

One deployment serves the module: ``verispec serve --ray --replicas 2`` started as a
subprocess that joins this process's Ray instance through RAY_ADDRESS (so the tests can
read Serve's status and kill a replica). The fault test runs last: it kills a replica.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving import wait_for_line

from verispec.server.routing import PrefixTable, prefix_keys, routing_text

RETRIES_HEADER = "x-verispec-retries"  # ray_serve.RETRIES_HEADER (that module needs Ray)

MODEL = "stories260k"
ROOT = Path(__file__).resolve().parents[2]  # the checkout
SERVER_ARGS = ["--model", MODEL, "--max-batch", "4", "--max-model-len", "512"]
PROMPTS = [f"Once upon a time, in a town called {town}, there lived a" for town in
           ("Maple", "Brook", "Stone", "River", "Cloud", "Pine", "Sand", "Frost")]


# ----------------------------------------------------------------------------- routing (no Ray)


def test_routing_text_prefix_relations() -> None:
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "Hi there"}]}'
    longer = (b'{"model": "m", "messages": [{"role": "user", "content": "Hi there"}, '
              b'{"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]}')
    assert routing_text("/v1/chat/completions", longer).startswith(routing_text("/v1/chat/completions", chat))
    assert routing_text("/v1/chat/completions", longer).endswith("assistant\x1fHello\x1e")
    assert routing_text("/v1/completions", b'{"prompt": [5, 6, 7]}') == "5,6,7,"
    assert routing_text("/v1/completions", b'{"prompt": ["ab", "cd"]}') == "ab"
    for bad in (b"not json", b"[1, 2]", b'{"prompt": 3}', b'{"messages": "x"}', b"[" * 100_000):
        assert routing_text("/v1/completions", bad) == "" and routing_text("/v1/chat/completions", bad) == ""


def test_prefix_keys_name_whole_prefixes() -> None:
    a, b = prefix_keys("a" * 100), prefix_keys("a" * 64 + "b" * 36)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # 100 chars = 3 whole 32-char blocks
    assert prefix_keys("x" * 31) == ()
    assert prefix_keys("b" + "a" * 99)[1] != a[1]  # a key depends on every earlier block
    assert len(prefix_keys("z" * 10_000, max_blocks=5)) == 5


def _match(t: PrefixTable, text: str, alive=("r1", "r2")):
    return t.match(prefix_keys(text), text, set(alive))


def _insert(t: PrefixTable, text: str, replica: str) -> None:
    t.insert(prefix_keys(text), text, replica)


def test_prefix_table_longest_live_owner_continuations_and_eviction() -> None:
    t = PrefixTable(capacity=4)
    system, turn1 = "s" * 64, "s" * 64 + "u" * 40  # a system prompt; a first turn (3 blocks + 8 chars)
    _insert(t, system + "hi", "r1")
    _insert(t, turn1, "r2")
    assert _match(t, turn1 + "answer, then turn 2") == ("r2", 3, True)  # its next turn
    assert _match(t, turn1) == ("r2", 3, True)  # the same prompt again
    assert _match(t, "s" * 64 + "u" * 32 + "v" * 8) == ("r2", 3, False)  # same blocks, another tail
    assert _match(t, system + "w" * 40) == ("r2", 2, False)  # r2 now owns the shared part
    assert _match(t, turn1, alive=("r1",)) == (None, 0, False)  # r2 is not a candidate
    _insert(t, turn1[:-8] + "x" * 8, "r2")  # a second prompt ending after the same block
    assert _match(t, turn1 + "more")[2] and _match(t, turn1[:-8] + "x" * 8 + "more")[2]
    t.drop("r2")
    assert len(t) == 0 and _match(t, system) == (None, 0, False)
    _insert(t, "q" * 32 * 6, "r1")  # 6 keys into a table of 4: the oldest two go
    assert len(t) == 4 and _match(t, "q" * 32 * 6) == ("r1", 6, True)
    assert _match(t, "q" * 64) == (None, 0, False)
    with pytest.raises(ValueError):
        PrefixTable(0)


def test_config_file_is_a_valid_serve_config() -> None:
    """deploy/ray-serve.yaml passes Ray Serve's own schema, and its args build a RayConfig."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from verispec.server.ray_serve import ENGINE, FRONTEND, config_from_args

    doc = yaml.safe_load((ROOT / "deploy" / "ray-serve.yaml").read_text())
    ServeDeploySchema.model_validate(doc) if hasattr(ServeDeploySchema, "model_validate") else \
        ServeDeploySchema.parse_obj(doc)
    (app,) = doc["applications"]
    assert app["import_path"] == "verispec.server.ray_serve:app_builder"
    config = config_from_args(app["args"])
    assert config.server.model == app["args"]["model"] and config.prefix_routing
    deployments = {d["name"]: d for d in app["deployments"]}
    scaling = deployments[ENGINE]["autoscaling_config"]
    assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"] and scaling["target_ongoing_requests"] > 0
    assert deployments[ENGINE]["ray_actor_options"]["num_cpus"] >= 1 and FRONTEND in deployments
    with pytest.raises(ValueError, match="unknown verispec args: colour"):
        config_from_args({"colour": "red"})
    cors = config_from_args({"cors": {"allowed_origins": ["http://localhost:3000"]}}).server.cors
    assert cors.allowed_origins == ("http://localhost:3000",) and cors.middleware_options() is not None
    for bad in ({"allowed_origins": "*"}, {"origins": ["*"]}, {"allowed_origins": ["http://a/"]}):
        with pytest.raises(ValueError, match="cors|allowed-origins"):
            config_from_args({"cors": bad})


def test_ray_config_refuses_what_cannot_deploy() -> None:
    from verispec.server.ray_serve import RayConfig

    for bad, message in [({"replicas": 0}, "--replicas must be >= 1"), ({"num_cpus": 0}, "CPUs per replica"),
                         ({"retries": -1}, "retries"),
                         ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas <= max_replicas"),
                         ({"autoscaling": {"min_replicas": 0, "max_replicas": 2}}, "min_replicas <= max_replicas")]:
        with pytest.raises(ValueError, match=message):
            RayConfig(**bad)
    scaled = RayConfig(autoscaling={"min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 8})
    assert (scaled.min_replicas, scaled.max_replicas) == (2, 5)


# ----------------------------------------------------------------------------- Ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_a_loopback_host_warns_when_the_cluster_listens_elsewhere(monkeypatch, capsys) -> None:
    """``--host`` on loopback joining a cluster whose nodes have network addresses: one line
    naming them (verispec cannot move a cluster's ports); a loopback cluster, or a host that
    listens everywhere anyway, says nothing."""
    import ray

    from verispec.server.ray_network import is_loopback, warn_if_exposed

    assert all(map(is_loopback, ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost", "::ffff:127.0.0.1")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.5", "192.0.2.2", "example.com", "")))
    for host, nodes, warned in [("127.0.0.1", ["10.0.0.5", "10.0.0.6"], ["10.0.0.5", "10.0.0.6"]),
                                ("localhost", ["192.0.2.2"], ["192.0.2.2"]), ("::1", ["127.0.0.1", "10.1.2.3"], ["10.1.2.3"]),
                                ("127.0.0.1", ["127.0.0.1"], []), ("0.0.0.0", ["10.0.0.5"], [])]:
        monkeypatch.setattr(ray, "nodes", lambda nodes=nodes: [{"Alive": True, "NodeManagerAddress": ip} for ip in nodes])
        warn_if_exposed(host, "10.0.0.5:6379")
        err = capsys.readouterr().err
        assert len(err.splitlines()) == (1 if warned else 0), err
        assert all(ip in err for ip in warned) and ("docs/ray.md" in err) == bool(warned)


def _listeners(root: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket listening in ``root``'s process tree,
    read from /proc: /proc/net/tcp{,6} maps socket inodes to addresses, /proc/PID/fd to pids."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    tree, grown = {root}, True
    while grown:
        more = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree, grown = tree | more, bool(more)
    owner: dict[str, int] = {}
    for pid in tree:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        owner[link[8:-1]] = pid
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in owner:  # 0A: LISTEN
                continue
            hexaddr, hexport = fields[1].split(":")
            raw = bytes.fromhex(hexaddr)  # 32-bit words in host (little-endian) order
            ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
            name = Path(f"/proc/{owner[fields[9]]}/comm").read_text().strip()
            found.append((str(ip), int(hexport, 16), name))
    return found


@pytest.mark.ray
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_serve_ray_on_loopback_listens_on_loopback_only(host: str) -> None:
    """A local Ray started for a loopback --host: GCS, raylet, workers, agents, the Serve
    proxy and the replicas' gRPC servers all listen on loopback (Ray has no authentication:
    a port on the network lets anyone join the cluster and run code); a request is answered."""
    from verispec.server.ray_network import is_loopback

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = _cli(*SERVER_ARGS, "--ray", "--host", host, "--port", str(port), env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _up(url, proc), 240, "the Ray deployment did not come up")
        wait_for_line(proc, "verispec: serving", 120)  # then its SIGTERM handler is in place
        listeners = _listeners(proc.pid)
        assert any(p == port for _, p, _ in listeners) and len(listeners) > 5, listeners
        assert [x for x in listeners if not is_loopback(x[0])] == []
        r = _post(url, _greedy(PROMPTS[0], 8))
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    finally:
        proc.terminate()
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "Traceback" not in out, out


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from verispec.server.ray_network import no_usage_stats

    no_usage_stats()
    ray.init(num_cpus=2, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_url(ray_cluster):
    """`verispec serve --ray --replicas 2` on this process's Ray instance."""
    port = _free_port()
    env = os.environ | {"RAY_ADDRESS": ray_cluster}
    proc = _cli(*SERVER_ARGS, "--ray", "--replicas", "2", "--port", str(port), env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _up(url, proc), 240, "the Ray deployment did not come up")
        yield url
    finally:
        proc.terminate()
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
        assert proc.returncode == 0, out
        assert "Traceback" not in out, out


def _up(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, proc.stdout.read()
    with contextlib.suppress(httpx.TransportError):
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    return False


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def plain():
    """The single-process server's app (same model and limits, one thread like a replica)."""
    import torch

    from verispec.server.app import ServerConfig, build_state, create_app

    torch.set_num_threads(1)
    state = build_state(ServerConfig(model=MODEL, max_batch=4, max_model_len=512))
    state.start()
    try:
        yield create_app(state)
    finally:
        state.close()


def _post(url: str, body: dict, route: str = "/v1/completions", timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}{route}", json={"model": MODEL} | body, timeout=timeout)


def _plain_answers(app, bodies: list[tuple[str, dict]]) -> list[httpx.Response]:
    import asyncio

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://plain", timeout=60) as c:
            return [await c.post(route, json={"model": MODEL} | body) for route, body in bodies]

    return asyncio.run(run())


def _greedy(prompt: str, max_tokens: int = 24, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True} | extra


def _concurrently(fn, items: list) -> list:
    out: list = [None] * len(items)

    def run(i: int) -> None:
        try:
            out[i] = fn(items[i])
        except Exception as e:  # noqa: BLE001 - reported by the caller's asserts
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client waited past its timeout"
    return out


@pytest.mark.ray
def test_two_replicas_answer_as_the_single_process_server(ray_url, plain) -> None:
    bodies = [("/v1/completions", _greedy(p)) for p in PROMPTS]
    bodies += [("/v1/completions", _greedy(PROMPTS[0], 8, logprobs=2, drafter="none")),
               ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.8, "seed": 3, "n": 2}),
               ("/v1/completions", _greedy(PROMPTS[2], 12, presence_penalty=0.5, repetition_penalty=1.2)),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),  # no chat template: 400
               ("/v1/completions", {"prompt": "x", "temperature": 9}),  # out of range: 400
               ("/v1/completions", {"model": "nope", "prompt": "x"})]  # 404
    want = _plain_answers(plain, bodies)
    got = _concurrently(lambda rb: _post(ray_url, rb[1], rb[0]), bodies)
    replicas = set()
    for (route, body), w, g in zip(bodies, want, got):
        assert g.status_code == w.status_code, (body, g.text)
        if w.status_code != 200:
            assert g.json() == w.json()  # the same OpenAI-shaped error
            continue
        gj, wj = g.json(), w.json()
        assert [c.get("token_ids") for c in gj["choices"]] == [c.get("token_ids") for c in wj["choices"]], body
        assert [c["text"] for c in gj["choices"]] == [c["text"] for c in wj["choices"]]
        assert [c["logprobs"] for c in gj["choices"]] == [c["logprobs"] for c in wj["choices"]]
        assert gj["verispec"]["replica"] == g.headers["x-verispec-replica"]
        assert "replica" not in wj["verispec"]  # the plain server names no replica
        replicas.add(gj["verispec"]["replica"])
    assert len(replicas) == 2, replicas  # concurrent requests spread over both replicas


@pytest.mark.ray
def test_streaming_openai_client_models_health_metrics(ray_url) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{ray_url}/v1", api_key="none", max_retries=0, timeout=60)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text != ""
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.model_extra["verispec"]["replica"]
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{ray_url}/health", timeout=10).json()["status"] == "ok"
    text = httpx.get(f"{ray_url}/metrics", timeout=10).text
    assert "verispec_requests_total" in text or "verispec_request" in text, text[:400]
    r = _post(ray_url, {"prompt": "x", "max_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.ray
def test_a_conversation_stays_on_one_replica(ray_url) -> None:
    """Each turn extends the last one's prompt: the router sends every turn of a conversation
    to the replica that served its first, whatever else runs meanwhile."""
    conversations = [f"{town} was a quiet town by the sea. One day a little dog" for town in ("Ash", "Elm", "Oak", "Yew")]
    seen: dict[int, set[str]] = {i: set() for i in range(len(conversations))}
    for _turn in range(3):
        replies = _concurrently(lambda p: _post(ray_url, _greedy(p, 12)), conversations)
        for i, r in enumerate(replies):
            assert r.status_code == 200, r
            seen[i].add(r.json()["verispec"]["replica"])
            conversations[i] += r.json()["choices"][0]["text"] + "\nThen"
    assert all(len(s) == 1 for s in seen.values()), seen


@pytest.mark.ray
def test_bad_config_is_one_line_and_exit_2(ray_cluster) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cases = [(["--replicas", "0"], "--replicas must be >= 1"), (["--model", "no-such-model"], "unknown model"),
             (["--replicas", str(os.cpu_count() + 1)], "CPUs"), (["--threads", "64"], "CPUs")]
    for args, message in cases:
        proc = _cli(*SERVER_ARGS, "--ray", *args, "--port", str(_free_port()), env=env)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 2, out
        assert message in out and len(out.strip().splitlines()) == 1 and "Traceback" not in out, out
    proc = _cli(*SERVER_ARGS, "--ray", "--port", str(_free_port()), env=env | {"RAY_ADDRESS": f"127.0.0.1:{_free_port()}"})
    out = proc.communicate(timeout=60)[0]  # Ray itself would retry an unreachable cluster for minutes
    assert proc.returncode == 2 and "cannot reach the Ray cluster" in out and len(out.strip().splitlines()) == 1, out
    # on a cluster (RAY_ADDRESS): its CPUs count, not this machine's
    proc = _cli(*SERVER_ARGS, "--ray", "--replicas", "2", "--threads", "2", "--port", str(_free_port()),
                env=env | {"RAY_ADDRESS": ray_cluster})
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2 and "the Ray cluster has 2" in out and "Traceback" not in out, out


def _engine_replicas() -> dict[str, int]:
    from ray import serve

    from verispec.server.ray_serve import APP_NAME, ENGINE

    return dict(serve.status().applications[APP_NAME].deployments[ENGINE].replica_states)


@pytest.mark.ray
def test_killing_a_replica_under_load(ray_url, plain) -> None:
    """A replica dies while a stream and plain requests run on it and on the other: every
    client gets an answer in time (the stream a final error event, the plain requests a retry
    on the survivor or a clean 503, the survivor's requests their own answers), Ray brings the
    deployment back to two replicas, and later requests are correct."""
    import ray

    from verispec.server.ray_serve import APP_NAME, ENGINE

    stream_body = _greedy(PROMPTS[0], 400, ignore_eos=True)
    # continuations of the stream's prompt: the router sends them to the stream's replica
    on_victim = [_greedy(PROMPTS[0] + tail, 300, ignore_eos=True) for tail in (" cat.", " bird.", " fox.")]
    elsewhere = [_greedy(p, 300, ignore_eos=True) for p in PROMPTS[4:7]]
    bodies = on_victim + elsewhere
    want = [r.json()["choices"][0]["text"] for r in _plain_answers(plain, [("/v1/completions", b) for b in bodies])]
    results: list = [None] * len(bodies)

    def post(i: int) -> None:
        results[i] = _safe_post(ray_url, bodies[i])

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    with httpx.stream("POST", f"{ray_url}/v1/completions", timeout=60,
                      json={"model": MODEL, "stream": True} | stream_body) as stream:
        victim = stream.headers["x-verispec-replica"]
        lines = stream.iter_lines()
        assert next(lines).startswith("data: {")  # tokens are flowing
        for t in threads:
            t.start()
        time.sleep(0.5)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{ENGINE}#{victim}", namespace="serve"))
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])
    assert error["error"]["code"] == "replica_unavailable", events[-3:]  # the stream was cut: said so
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client waited past its timeout"
    hit = 0
    for i, r in enumerate(results):
        assert not isinstance(r, Exception), r
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "replica_unavailable"
            hit += 1
            continue
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[i]  # on the survivor, or retried there
        assert r.json()["verispec"]["replica"] != victim
        hit += RETRIES_HEADER in r.headers
    assert hit >= 1  # the requests caught on the dead replica were retried (or refused), none was lost
    _wait(lambda: (s := _engine_replicas()).get("RUNNING") == 2 and len(s) == 1, 180,
          f"the deployment did not return to two replicas: {_engine_replicas()}")
    after = _concurrently(lambda p: _post(ray_url, _greedy(p, 16)), PROMPTS[:4])
    again = _plain_answers(plain, [("/v1/completions", _greedy(p, 16)) for p in PROMPTS[:4]])
    for r, w in zip(after, again):
        assert r.status_code == 200 and r.json()["verispec"]["replica"] != victim
        assert r.json()["choices"][0]["text"] == w.json()["choices"][0]["text"]


def _safe_post(url: str, body: dict) -> httpx.Response | Exception:
    try:
        return _post(url, body, timeout=90)
    except httpx.HTTPError as e:
        return e
