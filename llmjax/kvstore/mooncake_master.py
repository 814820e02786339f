"""Start a Mooncake Store master (the `mooncake_master` binary that ships in the
`mooncake-transfer-engine-non-cuda` wheel) the way the T3 tier (`mooncake_tier.py`) connects to
it: RPC and the embedded HTTP metadata server on one host, TCP transport.

    with start_master() as master:            # free ports on 127.0.0.1, waits until it serves
        tier = MooncakeTier(block_shape, master_address=master.master_address,
                            metadata_url=master.metadata_url)

    python -m llmjax.kvstore.mooncake_master  # runs one until Ctrl-C and prints how to connect

The flags it passes: `--enable_http_metadata_server=true --http_metadata_server_host/port`,
`--rpc_address/--rpc_port`, `--metrics_host/--metrics_port` (the admin server; its `/health`
says when the master serves), `--enable_metric_reporting=false` (no periodic summary in the
log), and `--default_kv_lease_ttl` when given (the read lease, module doc of mooncake_tier.py).
Other flags (`mooncake_master --help`): `extra_args`. The master's output goes to `log_path`.
In this build (0.3.13.post1) the metadata server listens on every interface whatever its host
flag says (RPC and admin do bind to `host`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import socket
import stat
import subprocess
import tempfile
import time
import urllib.error
import urllib.request


def master_binary() -> str:
    """The `mooncake_master` executable inside the installed wheel (found without importing
    the package, which would load its native libraries)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "mooncake is not installed: pip install 'llmjax[mooncake]' (the wheel "
            "mooncake-transfer-engine-non-cuda; it needs Debian's libibverbs1)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "mooncake_master")
        if os.path.isfile(path):
            if not os.access(path, os.X_OK):  # as the wheel's own `mooncake_master` script does
                os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return path
    raise FileNotFoundError("the mooncake wheel has no mooncake_master binary")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class MasterProcess:
    """A running `mooncake_master`; `stop()` (or the `with` block) ends it."""

    proc: subprocess.Popen
    host: str
    rpc_port: int
    http_port: int
    metrics_port: int
    log_path: str

    @property
    def master_address(self) -> str:
        """What a client passes as `master_server_addr`."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """The embedded HTTP metadata server (the transfer engine's `metadata_server`)."""
        return f"http://{self.host}:{self.http_port}/metadata"

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)

    def log_tail(self, num_chars: int = 2000) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return f.read()[-num_chars:]
        return ""

    def __enter__(self) -> MasterProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_master(
    host: str = "127.0.0.1",
    rpc_port: int = 0,
    http_port: int = 0,
    metrics_port: int = 0,
    kv_lease_ttl_ms: int | None = None,
    extra_args: tuple[str, ...] = (),
    log_path: str | None = None,
    timeout_s: float = 30.0,
) -> MasterProcess:
    """Start a master on `host` (ports 0: free ones) and wait until its RPC port accepts,
    its metadata server answers and its `/health` says it serves. Raises RuntimeError with the
    log's tail if it exits or does not serve within `timeout_s`."""
    binary = master_binary()
    tries = 3 if 0 in (rpc_port, http_port, metrics_port) else 1  # a free port can be taken
    for attempt in range(tries):
        ports = [p or free_port(host) for p in (rpc_port, http_port, metrics_port)]
        log = log_path or tempfile.mkstemp(prefix="mooncake_master_", suffix=".log")[1]
        args = [
            binary,
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={ports[1]}",
            f"--rpc_address={host}",
            f"--rpc_port={ports[0]}",
            f"--metrics_host={host}",
            f"--metrics_port={ports[2]}",
            "--enable_metric_reporting=false",
        ]
        if kv_lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={int(kv_lease_ttl_ms)}")
        args += list(extra_args)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        master = MasterProcess(proc, host, *ports, log)
        if _wait_serving(master, timeout_s):
            return master
        master.stop()
        if attempt + 1 == tries:
            raise RuntimeError(
                f"mooncake_master did not serve within {timeout_s} s "
                f"(exit code {proc.returncode}); log {log}:\n{master.log_tail()}"
            )
    raise AssertionError("unreachable")


def probe(master_address: str, metadata_url: str, timeout_s: float = 1.0) -> str | None:
    """Why a master (its RPC port) or its HTTP metadata server cannot be reached, or None if
    both answer: what a client checks before `setup`, which retries for about 90 s."""
    host, _, port = master_address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout_s).close()
    except (OSError, ValueError) as e:
        return f"master {master_address} unreachable ({e})"
    if metadata_url.startswith("http"):
        try:
            _OPENER.open(f"{metadata_url}?key=llmjax-probe", timeout=timeout_s).close()
        except urllib.error.HTTPError:
            pass  # it answered (404: no such key)
        except (OSError, ValueError) as e:
            return f"metadata server {metadata_url} unreachable ({e})"
    return None


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for these


def _wait_serving(master: MasterProcess, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not master.running:
            return False
        if probe(master.master_address, master.metadata_url, 0.5) is None:
            url = f"http://{master.host}:{master.metrics_port}/health"
            with contextlib.suppress(OSError, ValueError), _OPENER.open(url, timeout=1.0) as r:
                if json.loads(r.read()).get("service_ready"):
                    return True
        time.sleep(0.05)
    return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    p.add_argument("--rpc_port", type=int, default=50051)
    p.add_argument("--http_port", type=int, default=8080, help="HTTP metadata server")
    p.add_argument("--metrics_port", type=int, default=9003)
    p.add_argument("--kv_lease_ttl_ms", type=int, default=None)
    args, extra = p.parse_known_args()
    master = start_master(
        args.host, args.rpc_port, args.http_port, args.metrics_port, args.kv_lease_ttl_ms,
        tuple(extra),
    )  # fmt: skip
    print(
        f"mooncake_master serving (pid {master.proc.pid}, log {master.log_path})\n"
        f"  master_address = {master.master_address!r}\n"
        f"  metadata_url   = {master.metadata_url!r}\n"
        "  from llmjax.kvstore import MooncakeTier\n"
        f"  tier = MooncakeTier(block_shape, master_address={master.master_address!r}, "
        f"metadata_url={master.metadata_url!r})\n"
        "Ctrl-C stops it.",
        flush=True,
    )
    try:
        master.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        master.stop()


if __name__ == "__main__":
    main()
