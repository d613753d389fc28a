"""``serve --remote MODEL=ADDRESS``: a stage of this server served by another Triton server.

The model stays in this server under its own name, with its tensors and batching, but its
backend becomes ``omni_remote``, which forwards each request to the same model at ``ADDRESS``
(``host:port``, or ``dns:///name:port`` to balance over every address a name resolves to, as a
Kubernetes headless Service gives). ``omni``'s calls and the ensembles' steps are unchanged.

A stage may be remote when one response answers each request: ``ar_encoder`` (``omni_ar`` in
``encode`` mode) and ``diffusion`` (``omni_diffusion``, not decoupled). Streamed stages (``ar``,
``speech``, a decoupled ``diffusion``) and ``omni`` itself are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class RemoteSpecError(ValueError):
    pass


ADDRESS_FORMS = "HOST:PORT, dns:///NAME:PORT, or ipv4:IP:PORT,IP:PORT,..."


def parse(spec: str) -> tuple[str, str]:
    model, sep, address = spec.partition("=")
    if not sep or not model.strip() or not address.strip():
        raise RemoteSpecError(f"--remote must be MODEL=HOST:PORT (e.g. ar_encoder=encoder-pool:8001), got {spec!r}")
    address = address.strip()
    if not valid_address(address):  # gRPC would only say so at the first request, as UNKNOWN
        raise RemoteSpecError(f"--remote {spec!r}: {address!r} is not a gRPC address ({ADDRESS_FORMS})")
    return model.strip(), address


def valid_address(address: str) -> bool:
    """A target gRPC's channel takes: ``host:port``, a resolver's URI (``dns:///name:port``), or
    ``ipv4:``/``ipv6:`` followed by IP literals with their ports (several replicas, round robin)."""
    scheme, _, rest = address.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return bool(rest) and all(_host_and_port(entry, ip=True) for entry in rest.split(","))
    if scheme in ("dns", "unix", "unix-abstract") and rest:
        return True
    return _host_and_port(address)


def _host_and_port(entry: str, ip: bool = False) -> bool:
    """``host:port`` with a port in range; with ``ip``, the host an IP literal (``[...]`` for IPv6)."""
    import ipaddress

    host, _, port = entry.rpartition(":")
    if ip:
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return False
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def remote_edits(specs: list[str], repositories: list[Path]) -> dict[str, dict[str, Any]]:
    """``repository.copy_repositories``'s edits that make each named model a forwarder to its address."""
    from triton_omni_tools.repository import load_config

    edits: dict[str, dict[str, Any]] = {}
    for spec in specs:
        model, address = parse(spec)
        found = next((path for r in repositories if (path := Path(r) / model / "config.pbtxt").exists()), None)
        if found is None:
            raise RemoteSpecError(f"--remote {spec!r}: no model {model!r} in this server's repositories")
        config = load_config(found)
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        one_answer = (config.backend == "omni_ar" and parameters.get("mode") == "encode") or (
            config.backend == "omni_diffusion" and not config.model_transaction_policy.decoupled)
        if not one_answer:
            raise RemoteSpecError(f"--remote {spec!r}: model {model!r} streams its answers (or is omni itself); "
                                  "only ar_encoder and a diffusion model that answers once can be on another server")
        edits[model] = {"backend": "omni_remote", "instance_group": [{"kind": "KIND_CPU", "count": 1}],
                        "parameters": {"remote_url": address, "remote_backend": config.backend}}
    return edits
