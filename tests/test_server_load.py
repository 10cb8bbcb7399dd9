"""Load, cancellation, determinism, soak and admission tests of a real `moebox serve` process, driven by the
official `openai` client from several threads (issue 4, "What it must show").

The server is the session's `demo_server` (the built-in demo model, 4 cache slots, queue of 256); the soak and
the admission test start their own servers (the same settings; one slot and a queue of two) with one intra-op
thread: on 2 cores the engine thread, the HTTP loop and the client threads share the machine, and two OpenMP
threads then fight over it (the soak took about twice as long with them). Nothing waits on a fixed sleep: every
wait polls /metrics or /health under a deadline. The numbers worth reading (RSS, determinism) are printed: run
with -s.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.servers import Server, start_server

MODEL = "moebox-demo"
WORDS = ("the quick brown fox jumps over a lazy dog while moebox serves tokens in batches of four "
         "über naïve café 東京 😀 def main(): return 42 <think> </think> {\"json\": [1, 2]}").split()


def client(server: Server, timeout: float = 120) -> openai.OpenAI:
    # max_retries=0: a 503 must reach the test, not be retried away by the client
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=timeout)


def sample(server: Server, series: str) -> float:
    """One Prometheus sample by its exact series name with labels, e.g. 'x_total{reason="cancelled"}' (0 if
    the series does not exist yet)."""
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_until(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"not within {timeout} s: {what} (last: {last!r})")


def pool_state(server: Server) -> dict[str, float]:
    return {k: server.metric(f"moebox_{k}") for k in ("cache_usage", "requests_running", "requests_waiting")}


def wait_idle(server: Server, timeout: float = 30) -> None:
    """The engine holds no slot and queues nothing (the gauges read 0)."""
    wait_until(lambda: not any(pool_state(server).values()), timeout, f"idle pool: {pool_state(server)}")


def prompt(rng: random.Random, lo: int = 1, hi: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


class Watcher:
    """Polls the pool gauges in the background and keeps their maxima."""

    def __init__(self, server: Server) -> None:
        self.server, self.max = server, {"cache_usage": 0.0, "requests_running": 0.0, "requests_waiting": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, v in pool_state(self.server).items():
                self.max[k] = max(self.max[k], v)
            self._stop.wait(0.02)

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# ---------------------------------------------------------------------------------------------- concurrency
def test_16_concurrent_streams_all_finish(demo_server: Server) -> None:
    c = client(demo_server)
    wait_idle(demo_server)
    finished_before = demo_server.metric("moebox_requests_finished_total")

    def one(i: int) -> dict:
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}: " + "count to ten " * (i % 4)}],
            max_tokens=24, stream=True, stream_options={"include_usage": True})
        finishes, usage, chunks = [], None, 0
        for chunk in stream:
            chunks += 1
            finishes += [ch.finish_reason for ch in chunk.choices if ch.finish_reason]
            if chunk.usage is not None:
                usage = chunk.usage
        return {"finishes": finishes, "usage": usage, "chunks": chunks}

    t0 = time.perf_counter()
    with Watcher(demo_server) as w, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    print(f"\n16 concurrent streams: {time.perf_counter() - t0:.1f} s, pool maxima {w.max}")
    for r in results:
        assert len(r["finishes"]) == 1 and r["finishes"][0] in ("stop", "length"), r
        u = r["usage"]
        assert u is not None and u.prompt_tokens > 0 and 1 <= u.completion_tokens <= 24, r
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        if r["finishes"][0] == "length":
            assert u.completion_tokens == 24
    # more requests than slots: the queue was used and the slots never oversubscribed
    assert w.max["requests_running"] == 4 and w.max["requests_waiting"] > 0, w.max
    assert w.max["cache_usage"] <= 1.0
    wait_idle(demo_server)
    assert demo_server.metric("moebox_requests_finished_total") - finished_before == 16


# ---------------------------------------------------------------------------------------------- cancellation
def test_client_disconnect_frees_the_slot(demo_server: Server) -> None:
    c = client(demo_server)
    wait_idle(demo_server)
    cancelled = 'moebox_requests_finished_total{reason="cancelled"}'
    cancelled_before = sample(demo_server, cancelled)
    tokens_before = demo_server.metric("moebox_generation_tokens_total")

    stream = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "write a very long story"}], max_tokens=500,
        stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.content or getattr(chunk.choices[0].delta,
                                                                         "reasoning_content", None)):
            got += 1
            if got == 3:
                break
    assert got == 3
    assert demo_server.metric("moebox_requests_running") == 1
    assert demo_server.metric("moebox_cache_usage") > 0
    t0 = time.perf_counter()
    stream.close()                                    # the client goes away mid-stream

    wait_until(lambda: sample(demo_server, cancelled) >= cancelled_before + 1, 20, "a cancelled request")
    wait_idle(demo_server, timeout=20)
    freed = time.perf_counter() - t0
    generated = demo_server.metric("moebox_generation_tokens_total") - tokens_before
    print(f"\ndisconnect: slot freed {freed:.2f} s after close, {generated:.0f} of 500 tokens generated")
    assert sample(demo_server, cancelled) == cancelled_before + 1
    assert generated < 500
    # the server still serves
    r = c.completions.create(model=MODEL, prompt="still alive?", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_non_stream_client_that_gives_up_is_cancelled(demo_server: Server) -> None:
    """A non-stream request sends nothing until it is done: the server must still notice its client leaving."""
    wait_idle(demo_server)
    cancelled = 'moebox_requests_finished_total{reason="cancelled"}'
    cancelled_before = sample(demo_server, cancelled)
    tokens_before = demo_server.metric("moebox_generation_tokens_total")
    impatient = client(demo_server, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "take your time"}],
                                          max_tokens=500, extra_body={"ignore_eos": True})
    t0 = time.perf_counter()
    wait_until(lambda: sample(demo_server, cancelled) >= cancelled_before + 1, 20, "a cancelled request")
    wait_idle(demo_server, timeout=20)
    generated = demo_server.metric("moebox_generation_tokens_total") - tokens_before
    print(f"\nnon-stream disconnect: slot freed {time.perf_counter() - t0:.2f} s after the client timed out, "
          f"{generated:.0f} of 500 tokens generated")
    assert generated < 500


# ---------------------------------------------------------------------------------------------- determinism
def greedy_completion(c: openai.OpenAI, text: str, max_tokens: int = 32):
    r = c.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0, logprobs=0,
                             extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == max_tokens
    return ch.text, ch.logprobs.tokens, ch.logprobs.token_logprobs


def greedy_chat(c: openai.OpenAI, text: str, max_tokens: int = 32) -> tuple[str | None, str | None]:
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == max_tokens
    m = r.choices[0].message
    return getattr(m, "reasoning_content", None), m.content


def test_greedy_alone_equals_greedy_in_a_busy_batch(demo_server: Server) -> None:
    c = client(demo_server)
    wait_idle(demo_server)
    probe_prompt = "The capital of France is a city whose name"
    chat_prompt = "Explain continuous batching in one sentence."
    alone = greedy_completion(c, probe_prompt)
    alone_chat = greedy_chat(c, chat_prompt)

    # keep the server busy: 3 slots decoding long sequences at other positions, more requests queued behind
    rng = random.Random(3)
    stop = threading.Event()

    def noise(i: int) -> None:
        while not stop.is_set():
            c.completions.create(model=MODEL, prompt=prompt(rng, 5, 120), max_tokens=rng.randint(8, 60),
                                 temperature=0.8, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(noise, i) for i in range(5)]
        try:
            wait_until(lambda: demo_server.metric("moebox_requests_running") >= 3, 30, "a busy batch")
            with Watcher(demo_server) as w:
                busy_f = pool.submit(greedy_completion, c, probe_prompt)
                busy_chat = greedy_chat(c, chat_prompt)
                busy = busy_f.result(timeout=120)
        finally:
            stop.set()
        for f in futs:
            f.result(timeout=120)
    print(f"\ndeterminism: pool maxima while the probes ran {w.max}")
    assert w.max["requests_running"] >= 3, "the probes did not share the batch"

    same_tokens = sum(a == b for a, b in zip(alone[1], busy[1]))
    max_lp = max(abs(a - b) for a, b in zip(alone[2], busy[2]))
    print(f"determinism: completions {same_tokens}/{len(alone[1])} tokens equal, text equal: {alone[0] == busy[0]}, "
          f"max |logprob alone - busy| = {max_lp:.3g}; chat equal: {alone_chat == busy_chat}")
    assert busy[1] == alone[1]
    assert busy[0] == alone[0]
    assert busy_chat == alone_chat
    wait_idle(demo_server)


# ---------------------------------------------------------------------------------------------- soak
def soak_request(c: openai.OpenAI, rng: random.Random) -> str:
    """One random request; returns 'cancelled', 'ok', or raises. Errors are assertion failures."""
    kind, stream = rng.choice(("chat", "completion")), rng.random() < 0.5
    cancel_after = rng.randint(1, 4) if stream and rng.random() < 0.4 else None   # ~20% of all requests
    max_tokens = rng.randint(8, 40) if cancel_after else rng.randint(1, 40)
    sampling = rng.choice(({"temperature": 0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.0},
                           {"temperature": 1.0, "seed": rng.randint(0, 99), "extra_body": {"top_k": 20}},
                           {"temperature": 0.5, "presence_penalty": 0.5, "frequency_penalty": 0.3},
                           {"temperature": 0.8, "extra_body": {"min_p": 0.05, "ignore_eos": True}}))
    text = prompt(rng)
    if kind == "chat":
        args = dict(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, **sampling)
        if rng.random() < 0.3:
            args["reasoning_effort"] = "high"
        create = c.chat.completions.create
    else:
        args = dict(model=MODEL, prompt=text, max_tokens=max_tokens, **sampling)
        create = c.completions.create
    if not stream:
        r = create(**args)
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length"), r
        assert 1 <= r.usage.completion_tokens <= max_tokens, r.usage
        return "ok"
    s = create(**args, stream=True, stream_options={"include_usage": True})
    finishes, usage, seen = [], None, 0
    for chunk in s:
        finishes += [ch.finish_reason for ch in chunk.choices if ch.finish_reason]
        usage = chunk.usage or usage
        seen += 1
        if cancel_after is not None and seen > cancel_after:
            s.close()
            return "cancelled"
    assert len(finishes) == 1 and finishes[0] in ("stop", "length"), finishes
    assert usage is not None and 1 <= usage.completion_tokens <= max_tokens, usage
    return "ok"


def own_server(tmp_path_factory: pytest.TempPathFactory, name: str, args: list[str]) -> Server:
    tmp = tmp_path_factory.mktemp(name)
    return start_server(args, tmp / "cache", tmp / "server.log")


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt):
    """The server's own robustness under load, so the tiny model (the trained demo is ~10x slower per token)."""
    server = own_server(tmp_path_factory, "soak-server", [str(tiny_ckpt), "--served-model-name", MODEL,
                                                          "--max-num-seqs", "4", "--max-waiting", "256"])
    yield server
    server.stop()


def test_soak_200_mixed_requests(soak_server: Server) -> None:
    c = client(soak_server)
    with ThreadPoolExecutor(8) as pool:                 # warm-up: every code path once, allocator settled
        list(pool.map(lambda i: soak_request(c, random.Random(1000 + i)), range(16)))
    wait_idle(soak_server)
    rss_before = soak_server.rss_bytes()
    finished_before = soak_server.metric("moebox_requests_finished_total")

    outcomes: dict[str, int] = {"ok": 0, "cancelled": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            out = soak_request(c, random.Random(i))
            with lock:
                outcomes[out] += 1
        except Exception as e:                          # noqa: BLE001 - every failure is reported below
            with lock:
                errors.append(f"request {i}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    with Watcher(soak_server) as w, ThreadPoolExecutor(8) as pool:
        list(pool.map(worker, range(200)))
    took = time.perf_counter() - t0
    wait_idle(soak_server, timeout=30)
    rss_after = soak_server.rss_bytes()
    finished = soak_server.metric("moebox_requests_finished_total") - finished_before
    mb = 1024 * 1024
    print(f"\nsoak: 200 requests in {took:.1f} s: {outcomes}, {len(errors)} errors, engine finished {finished:.0f}, "
          f"pool maxima {w.max}")
    print(f"soak: server RSS after warm-up {rss_before / mb:.1f} MiB, after soak {rss_after / mb:.1f} MiB "
          f"({(rss_after - rss_before) / mb:+.1f} MiB, {100 * (rss_after / rss_before - 1):+.1f}%)")
    assert not errors, "\n".join(errors[:10])
    assert outcomes["ok"] + outcomes["cancelled"] == 200
    assert outcomes["cancelled"] >= 20, outcomes
    assert finished == 200                             # every request left the engine exactly once
    assert pool_state(soak_server) == {"cache_usage": 0.0, "requests_running": 0.0, "requests_waiting": 0.0}
    assert rss_after <= rss_before + max(0.15 * rss_before, 100 * mb)


# ---------------------------------------------------------------------------------------------- admission
@pytest.fixture(scope="module")
def tiny_queue_server(tmp_path_factory: pytest.TempPathFactory):
    server = own_server(tmp_path_factory, "admission-server", ["--max-num-seqs", "1", "--max-waiting", "2"])
    yield server
    server.stop()


def test_admission_control_503_past_the_queue(tiny_queue_server: Server) -> None:
    server = tiny_queue_server
    c = client(server)
    n, max_tokens = 12, 48
    barrier = threading.Barrier(n)

    def one(i: int):
        messages = [{"role": "user", "content": f"request {i}"}]
        barrier.wait(timeout=30)
        try:
            if i % 2:
                r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                              extra_body={"ignore_eos": True})
                return "ok", r.choices[0].finish_reason, r.usage.completion_tokens
            s = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, stream=True,
                                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            finishes, usage = [], None
            for chunk in s:
                finishes += [ch.finish_reason for ch in chunk.choices if ch.finish_reason]
                usage = chunk.usage or usage
            return "ok", finishes[0] if len(finishes) == 1 else finishes, usage.completion_tokens
        except openai.APIStatusError as e:
            return "status", e.status_code, e.body

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    rejected = [r for r in results if r[0] == "status"]
    done = [r for r in results if r[0] == "ok"]
    print(f"\nadmission: {len(done)} completed, {len(rejected)} got 503 in {time.perf_counter() - t0:.1f} s")
    assert rejected and done, results
    for _, status, body in rejected:
        assert status == 503, (status, body)
        assert isinstance(body, dict) and body["type"] == "service_unavailable_error" and body["message"], body
        assert body["code"] == "server_busy"
    for _, finish, tokens in done:    # "stop" when the message was complete before the budget ran out
        assert finish in ("length", "stop") and tokens == max_tokens
    assert server.metric("moebox_requests_rejected_total") == len(rejected)

    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    wait_idle(server)
    r = c.completions.create(model=MODEL, prompt="after the storm", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    wait_idle(server)
