"""hanzo_torch.server with real clients (openai, httpx) against a server on 127.0.0.1."""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import hanzo_torch
from qwen_vocab import toy_tokenizer_metadata
from tests.gguf_builders import tiny_spec, write_tiny_gguf

openai = pytest.importorskip("openai", reason="the openai client is in the [test] and [serve] extras")
httpx = pytest.importorskip("httpx", reason="httpx is in the [test] and [serve] extras")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is in the [test] and [serve] extras")

from hanzo_torch.server import create_app  # noqa: E402

CTX = 96
QTYPES = {"attn": "Q8_0", "ffn": "Q4_K", "ffn_down": "Q6_K", "embd": "Q8_0", "output": "Q8_0"}


class Server:
    def __init__(self, model, **kw):
        self.app = create_app(model, **kw)
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            assert time.time() - t0 < 30 and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def health(self):
        return httpx.get(self.url + "/health").json()

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    spec = tiny_spec("qwen3", n_layer=1, tied=False, qtypes=QTYPES)
    return write_tiny_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf", spec, toy_tokenizer_metadata())


@pytest.fixture(scope="module")
def reference(path):
    return hanzo_torch.load(path, max_context=CTX)  # generate() answers (the served model is another object)


@pytest.fixture(scope="module")
def server(path):
    srv = Server(hanzo_torch.load(path, max_context=CTX), n_parallel=4, max_queue=64)
    yield srv
    srv.close()


def greedy(reference, prompt, n):
    return reference.generate(prompt, max_new_tokens=n, temperature=0, ignore_eos=True).text


def test_chat_completions_and_models(server, reference):
    msgs = [{"role": "user", "content": "hello"}]
    r = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == greedy(reference, msgs, 10)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    stream = server.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in server.client.models.list().data] == ["tiny.gguf"]
    assert server.health()["status"] == "ok"


def test_completions_stop_and_ids(server, reference):
    want = greedy(reference, "the fox", 12)
    r = server.client.completions.create(model="tiny", prompt="the fox", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    ids = reference.tokenizer.encode("the fox")
    r = server.client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    stop = want[4:6]
    r = server.client.completions.create(model="tiny", prompt="the fox", max_tokens=12, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == want[:want.find(stop)] and r.choices[0].finish_reason == "stop"
    # a seed gives the same sampled answer as generate() with that seed
    kw = dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    want = reference.generate("the fox", max_new_tokens=8, ignore_eos=True, **kw).text
    r = server.client.completions.create(model="tiny", prompt="the fox", max_tokens=8, temperature=0.9, top_p=1.0,
                                         seed=11, extra_body={"ignore_eos": True, "top_k": 0, "min_p": 0.0})
    assert r.choices[0].text == want


def test_32_concurrent_streams(server, reference):
    """Continuous batching under load: 32 streamed clients on 4 slots, each answer complete and
    equal to that prompt's single-request answer."""
    prompts = [f"prompt {i} " + "x" * (i % 7) for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    want = [greedy(reference, p, n) for p, n in zip(prompts, lengths)]

    def one(i):
        s = server.client.completions.create(model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        chunks = list(s)
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    assert [g[0] for g in got] == want
    assert all(g[1] == "length" for g in got)
    assert server.health()["slots_busy"] == 0


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 * CTX}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "x " * (3 * CTX)}]}, "messages"),
])
def test_bad_chat_requests_get_400(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_bad_bodies_get_400(server):
    for content, where in ((b"{not json", "/v1/chat/completions"), (b"[1, 2]", "/v1/completions")):
        r = httpx.post(server.url + where, content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"]
    for prompt in ([-1], {"a": 1}, None):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="tiny", prompt="x", max_tokens=CTX + 5)


def test_disconnect_mid_stream_frees_its_slot(server):
    before = server.health()["requests_cancelled"]
    body = {"prompt": "a long one", "max_tokens": CTX - 16, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
    t0 = time.time()
    while True:
        h = server.health()
        if h["slots_busy"] == 0 and h["requests_cancelled"] == before + 1:
            break
        assert time.time() - t0 < 20, h
        time.sleep(0.05)


def test_queue_full_503_and_errors_keep_the_server_up(path):
    model = hanzo_torch.load(path, max_context=CTX)
    srv = Server(model, n_parallel=1, max_queue=1)
    try:
        body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        # the model worker blocks inside the first request's forward until the gate opens, so the
        # slot stays busy and the second request stays queued however slow the machine is
        gate = threading.Event()
        hold = model.output_norm.register_forward_pre_hook(lambda m, a: gate.wait(60) and None)
        try:
            with ThreadPoolExecutor(2) as pool:
                busy = [pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=60)]
                t0 = time.time()
                while srv.health()["slots_busy"] == 0:
                    assert time.time() - t0 < 20
                    time.sleep(0.02)
                busy.append(pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=60))
                t0 = time.time()
                while srv.health()["requests_waiting"] == 0:  # the second waits in the queue
                    assert time.time() - t0 < 20
                    time.sleep(0.02)
                r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)  # the third is refused
                assert r.status_code == 503, r.text
                assert r.headers["Retry-After"] and r.json()["error"]["message"]
                gate.set()
                assert [f.result().status_code for f in busy] == [200, 200]
        finally:
            gate.set()
            hold.remove()
        # logits turning NaN during a request: HTTP 500 naming the file; the next request works
        handle = model.output_norm.register_forward_hook(
            lambda m, a, o: (o[0] if a[0].shape[1] > 1 else torch.full_like(o[0], float("nan")), o[1]))
        try:
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=60)
        finally:
            handle.remove()
        assert r.status_code == 500 and model.gguf.path in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        srv.close()


def test_serve_cli_checks_arguments_before_loading(capsys):
    from hanzo_torch import cli

    assert cli.main(["serve", "-m", "/nonexistent.gguf", "--port", "0"]) == 2
    assert "--port" in capsys.readouterr().err
    assert cli.main(["serve", "-m", "/nonexistent.gguf", "-np", "4", "-c", "2"]) == 2
    assert "-np 4" in capsys.readouterr().err
    assert cli.main(["serve", "-m", "/nonexistent.gguf", "--tp", "2"]) == 2
    assert "tensor parallel" in capsys.readouterr().err


@pytest.mark.slow  # a fresh process imports torch and loads the model: ~20 s on 2 cores
def test_sigterm_finishes_running_requests_then_exits(path):
    """``hanzo-torch serve`` in its own process: SIGTERM while a request streams lets it finish."""
    import os
    import signal
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-m", "hanzo_torch", "serve", "-m", path, "--port", str(port),
                             "-np", "2", "-c", str(2 * CTX)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() - t0 < 120
            time.sleep(0.1)
        body = {"prompt": "x", "max_tokens": CTX - 4, "temperature": 0, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                if not lines:
                    proc.send_signal(signal.SIGTERM)
                lines.append(line)
        assert lines[-1] == "data: [DONE]"
        tokens = json.loads([ln for ln in lines if ln.startswith("data: {")][-1][6:])["usage"]["completion_tokens"]
        assert tokens == CTX - 4
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
