"""The `transfer_server` KV transport (llmjax/cluster/transfer_server.py, jax.experimental.transfer)
on the tiny model and fake CPU devices over 127.0.0.1: in one process (the KV moves bitwise, a
pull may start before its offer, deadlines win over pulls that never complete, one pull per offer,
leases free the arrays, a Cluster serves with it), and across two processes (a prefill worker
process offers a prompt's KV, this process decodes it to the colocated tokens; a killed worker
fails the pull by its deadline, never a hang).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle
import queue
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from llmjax import LLM, SamplingParams
from llmjax.cluster.cluster import Cluster
from llmjax.cluster.instance import LocalInstance
from llmjax.cluster.transfer import TransferError, kv_head_map
from llmjax.cluster.transfer_server import ServerOffer, TransferServerTransport
from llmjax.cluster.transports import make_transport
from tests.transfer_server_worker import MAX_TOKENS, OPTS, PROMPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "transfer_server_worker.py")
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [PROMPT, [5, 9, 13, 17, 21, 25, 29], list(range(30, 52)), [250, 3, 77, 4, 1]]


def _runner(role: str, device: int):
    return LLM("tiny", role=role, devices=[jax.devices()[device]], **OPTS).engine.runner


@pytest.fixture(scope="module")
def runners():
    """A prefill runner (cpu:3) whose pages hold random KV, and a decode runner (cpu:4)."""
    a, b = _runner("prefill", 3), _runner("decode", 4)
    rng = np.random.default_rng(0)
    n = OPTS["num_pages"] - 1  # every page but the reserved page 0
    kv = rng.standard_normal(a.transfer_shape(n)).astype(a.dtype)
    a.import_pages(list(range(1, n + 1)), jax.device_put(kv, a.kv_transfer_sharding))
    return a, b


@pytest.fixture(scope="module")
def llms():
    """Engines on their own devices: prefill (cpu:0), decode (cpu:1), colocated (cpu:2), and the
    colocated greedy tokens of PROMPTS (the reference)."""
    devices = jax.devices()
    prefill = LLM("tiny", role="prefill", devices=[devices[0]], **OPTS)
    decode = LLM("tiny", role="decode", devices=[devices[1]], **OPTS)
    colocated = LLM("tiny", devices=[devices[2]], **OPTS)
    want = [o.token_ids for o in colocated.generate(PROMPTS, GREEDY)]
    return prefill, decode, want


def _wait(transport, handle, seconds: float = 10.0):
    """poll until the array arrives (bounded)."""
    end = time.time() + seconds
    while (data := transport.poll(handle)) is None:
        assert time.time() < end, "the pull did not complete"
        time.sleep(0.005)
    return data


def test_pull_moves_the_kv_bitwise_between_runners(runners):
    a, b = runners
    transport = make_transport("transfer_server")
    assert isinstance(transport, TransferServerTransport)
    pages = [3, 9, 4]  # non-contiguous; padded to a bucket of 4
    offer = transport.offer(a, "r", pages)
    want = np.asarray(a.export_pages(pages))
    assert np.abs(want[:, :, :3]).sum() > 0  # real KV
    assert isinstance(offer, ServerOffer) and offer.address.startswith("127.0.0.1:")
    assert offer.shape == a.transfer_shape(3) and offer.num_pages == 3
    assert offer.nbytes == want.nbytes and offer.kv_heads == kv_head_map(a)
    assert pickle.loads(pickle.dumps(offer)) == offer  # plain data for the control plane
    assert transport.num_offers == 1
    data = _wait(transport, transport.pull(offer, b, time.time() + 10))
    assert data.sharding == b.kv_transfer_sharding
    np.testing.assert_array_equal(np.asarray(data), want)
    b.import_pages([10, 11, 12], data)
    got = np.asarray(b.export_pages([10, 11, 12]))
    np.testing.assert_array_equal(got[:, :, :3], want[:, :, :3])
    transport.release(offer)
    assert transport.num_offers == 0


def test_pull_before_offer_completes_once_offered(runners, monkeypatch):
    """The decode side may start pulling before the prefill side offered: it stays in flight
    (poll: None) and completes once the offer is made."""
    import llmjax.cluster.transfer_server as ts

    a, b = runners
    transport = TransferServerTransport()
    _, address = transport.server(a)
    pages = [5, 6]
    uuid = 123456789
    early = ServerOffer(
        transfer_id=uuid,
        request_id="early",
        num_pages=2,
        shape=a.transfer_shape(2),
        dtype=str(a.dtype),
        nbytes=0,
        kv_heads=kv_head_map(a),
        lease_deadline=time.time() + 60,
        address=address,
        shards=((0, a.transfer_shape(2)[4]),),
    )
    handle = transport.pull(early, b, time.time() + 10)
    for _ in range(20):
        assert transport.poll(handle) is None
        time.sleep(0.01)
    monkeypatch.setattr(ts.secrets, "randbits", lambda bits: uuid)
    offer = transport.offer(a, "early", pages)
    assert offer.transfer_id == uuid
    data = _wait(transport, handle)
    np.testing.assert_array_equal(np.asarray(data), np.asarray(a.export_pages(pages)))
    transport.release(offer)


def test_an_offer_never_made_fails_by_the_deadline(runners):
    """jax's pull has no timeout of its own (it would wait forever): poll returns None until
    our deadline, then raises; nothing blocks (no thread is left behind)."""
    a, b = runners
    transport = TransferServerTransport()
    real = transport.offer(a, "r", [1])
    never = dataclasses.replace(real, transfer_id=real.transfer_id ^ 1, request_id="never")
    deadline = time.time() + 0.5
    handle = transport.pull(never, b, deadline)
    t0 = time.perf_counter()
    assert transport.poll(handle) is None
    assert time.perf_counter() - t0 < 0.1  # poll returns at once
    # LocalInstance.poll_imports' loop: poll, and fail once past the deadline
    with pytest.raises(TransferError, match="deadline"):
        while transport.poll(handle) is None:
            assert time.time() < deadline + 5
            time.sleep(0.01)
    assert time.time() >= deadline
    transport.release(real)


def test_one_pull_per_offer(runners):
    a, b = runners
    transport = TransferServerTransport()
    offer = transport.offer(a, "r", [2, 3])
    _wait(transport, transport.pull(offer, b, time.time() + 10))
    second = transport.pull(offer, b, time.time() + 10)
    with pytest.raises(TransferError, match="already pulled"):
        transport.poll(second)
    # another transport (as another decode process would): jax keeps that pull pending (the
    # offer was consumed by the first), so it runs into its deadline
    other = TransferServerTransport()
    handle = other.pull(offer, b, time.time() + 0.3)
    with pytest.raises(TransferError, match="deadline"):
        _wait(other, handle, seconds=5)
    transport.release(offer)


def test_a_lease_expiry_frees_the_arrays(runners):
    a, b = runners
    transport = TransferServerTransport(lease_s=30.0)
    offer = transport.offer(a, "r", [7, 8])
    assert transport.expire() == []  # not yet
    assert transport.expire(now=time.time() + 31) == [offer]
    assert transport.num_offers == 0
    handle = transport.pull(offer, b, time.time() + 10)
    with pytest.raises(TransferError, match="released, expired"):
        _wait(transport, handle)  # the buffers were deleted: fails at once, not by deadline
    # offer() expires the stale ones by itself
    short = TransferServerTransport(lease_s=0.0)
    first = short.offer(a, "r1", [1])
    time.sleep(0.01)
    second = short.offer(a, "r2", [2])
    assert short.num_offers == 1
    short.release(second)
    assert short.expire() == [] and short.num_offers == 0
    assert first.transfer_id != second.transfer_id


@pytest.mark.parametrize(
    "src_tp, dst_tp",
    [(2, 4), (4, 1), (1, 2)],  # repeat heads / heads repeated at the source / split one shard
)
def test_another_tp_on_the_decode_side_moves_every_head_bitwise(src_tp, dst_tp):
    """The shards land on the decode side's devices and are resharded there, head by head; a
    source that repeats heads over its devices sends each head once."""
    devices = jax.devices()
    a = LLM("tiny", role="prefill", tp=src_tp, devices=devices[:src_tp], **OPTS).engine.runner
    b = LLM("tiny", role="decode", tp=dst_tp, devices=devices[8 - dst_tp :], **OPTS).engine.runner
    kv = np.random.default_rng(1).standard_normal(a.transfer_shape(3)).astype(a.dtype)
    a.import_pages([1, 2, 3], jax.device_put(kv, a.kv_transfer_sharding))
    transport = TransferServerTransport()
    offer = transport.offer(a, "r", [1, 2, 3])
    src = np.asarray(a.export_pages([1, 2, 3]))
    src_heads, dst_heads = kv_head_map(a), kv_head_map(b)
    unique = len(set(src_heads) - {-1})
    assert offer.nbytes == src.nbytes * unique // len(src_heads)
    data = _wait(transport, transport.pull(offer, b, time.time() + 10))
    assert data.sharding == b.kv_transfer_sharding
    b.import_pages([4, 5, 6], data)
    dst = np.asarray(b.export_pages([4, 5, 6]))
    for j, h in enumerate(dst_heads):
        np.testing.assert_array_equal(dst[:, :, :3, :, j], src[:, :, :3, :, src_heads.index(h)])
    transport.release(offer)


def test_a_timed_out_pull_retires_its_connection(runners):
    """Past its deadline a pending pull's connection is retired (closed once no pull uses it:
    that frees the buffers jax holds for it); pulls after that connect afresh and work. A pull
    nobody polls any more is ended by the next pull once past its deadline."""
    a, b = runners
    transport = TransferServerTransport()
    real = transport.offer(a, "r", [4])
    never = dataclasses.replace(real, transfer_id=real.transfer_id ^ 1)
    abandoned = transport.pull(never, b, time.time() + 0.2)
    first = abandoned.connection
    assert transport.num_pulls == 1
    time.sleep(0.3)
    handle = transport.pull(real, b, time.time() + 10)  # sweeps the abandoned one
    assert transport.num_pulls == 1 and handle.connection is not first
    assert first.retired and first.inflight == 0
    with pytest.raises(TransferError, match="deadline"):
        transport.poll(abandoned)
    np.testing.assert_array_equal(
        np.asarray(_wait(transport, handle)), np.asarray(a.export_pages([4]))
    )
    assert transport.num_pulls == 0
    transport.release(real)


def test_one_server_per_process(runners):
    a, _ = runners
    _, address = TransferServerTransport().server(a)
    assert TransferServerTransport().server(a)[1] == address  # shared
    with pytest.raises(ValueError, match="one server per process"):
        TransferServerTransport(address="127.0.0.1:1").server(a)
    with pytest.raises(ValueError, match="host:port"):
        TransferServerTransport(address="localhost")


# ---- two processes -------------------------------------------------------------------------


class _Worker:
    """tests/transfer_server_worker.py in a subprocess, its stdout read by a daemon thread."""

    def __init__(self, log_path):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
        env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
        cache = jax.config.jax_compilation_cache_dir
        if cache:  # the test run's persistent compilation cache (tests/conftest.py)
            env["JAX_COMPILATION_CACHE_DIR"] = cache
            env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, WORKER],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float = 90.0) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no line from the worker in {timeout} s; log:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def offer(self):
        line = self.line()
        assert line.startswith("OFFER "), f"{line!r}; log:\n{self.log()}"
        return pickle.loads(base64.b64decode(line[len("OFFER ") :]))

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()


def _decode_to_end(engine, rid: str) -> list[int]:
    tokens = None
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id == rid:
                tokens = out.token_ids
    assert not engine.has_unfinished_requests()
    return tokens


def _poll_imports(inst, seconds: float):
    end = time.time() + seconds
    while not (results := inst.poll_imports()):
        assert time.time() < end, "poll_imports returned nothing"
        time.sleep(0.01)
    return results


def test_two_processes_prefill_there_decode_here(llms, tmp_path):
    """A prefill process offers PROMPT's KV; this process pulls it (loopback), imports it and
    decodes to the colocated engine's tokens."""
    _, decode, want = llms
    worker = _Worker(tmp_path / "worker.log")
    try:
        m, offer = worker.offer()
        assert offer.address != TransferServerTransport().server(decode.engine.runner)[1]
        inst = LocalInstance(decode.engine, TransferServerTransport())
        inst.begin_import(m, offer, timeout_s=30.0, on_failure="fail")
        [res] = _poll_imports(inst, 30.0)
        assert res.status == "done", res.error
        assert res.nbytes == offer.nbytes > 0
        assert _decode_to_end(decode.engine, "r") == want[0]
        worker.proc.stdin.write("release\n")
        worker.proc.stdin.flush()
        assert worker.line(timeout=30) == "RELEASED"
        assert worker.proc.wait(timeout=30) == 0
    finally:
        worker.close()


def test_two_processes_a_killed_prefill_process_fails_the_pull(llms, tmp_path):
    """The prefill process dies: a pull in flight on its connection fails at once ('Connection
    closed'); a pull that starts after (nothing listens) fails by its deadline. No hang, and
    the decode engine goes on."""
    _, decode, _ = llms
    worker = _Worker(tmp_path / "worker.log")
    transport = TransferServerTransport()
    try:
        m, offer = worker.offer()
        # in flight when it dies: a pull of an offer the worker never makes
        pending = dataclasses.replace(offer, transfer_id=offer.transfer_id ^ 1)
        handle = transport.pull(pending, decode.engine.runner, time.time() + 60)
        time.sleep(0.2)
        assert transport.poll(handle) is None
        worker.proc.kill()
        worker.proc.wait(timeout=30)
        t0 = time.time()
        with pytest.raises(TransferError, match="failed"):
            _wait(transport, handle, seconds=20)
        assert time.time() - t0 < 20  # the dead connection, not the 60 s deadline
        # after it died: the deadline wins
        inst = LocalInstance(decode.engine, transport)
        t0 = time.time()
        inst.begin_import(m, offer, timeout_s=1.0, on_failure="fail")
        [res] = _poll_imports(inst, 20.0)
        assert res.status == "failed" and res.request_id == "r"
        assert 1.0 <= time.time() - t0 < 20
        _decode_to_end(decode.engine, "r")  # the failed request's error output, then idle
        assert decode.engine.block_manager.num_used_pages == 0
    finally:
        worker.close()


# ---- a cluster -----------------------------------------------------------------------------


def test_cluster_with_the_transfer_server_equals_colocated(llms):
    prefill, decode, want = llms
    transport = TransferServerTransport()
    instances = [LocalInstance(prefill.engine, transport), LocalInstance(decode.engine, transport)]
    cluster = Cluster(instances)
    got = [o.token_ids for o in cluster.generate(PROMPTS, GREEDY)]
    assert got == want
    st = cluster.transfer_stats
    assert st.num_transfers == len(PROMPTS) and st.num_failures == 0 and st.bytes > 0
    assert transport.num_offers == 0
    for inst in instances:
        assert inst.engine.block_manager.num_used_pages == 0 and not inst.engine.parked
