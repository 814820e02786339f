"""The KV transports by name (`make_transport`): 'local' (transfer.py's `LocalTransport`: one
process's arrays) and 'transfer_server' (transfer_server.py: jax's transfer server between
processes). Both implement transfer.py's `KVTransport`."""

from __future__ import annotations

from llmjax.cluster.transfer import KVTransport, LocalTransport

TRANSPORTS = ("local", "transfer_server")


def make_transport(name: str, **kwargs) -> KVTransport:
    """A transport of TRANSPORTS by name, built with `kwargs`."""
    if name == "local":
        return LocalTransport(**kwargs)
    if name == "transfer_server":
        from llmjax.cluster.transfer_server import TransferServerTransport

        return TransferServerTransport(**kwargs)
    raise ValueError(f"unknown KV transport {name!r}; choose one of {TRANSPORTS}")
