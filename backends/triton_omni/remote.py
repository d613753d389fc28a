"""A stage on another Triton server, called over gRPC with the tensors a local call would pass.

``RemoteStage`` is what the ``omni_remote`` backend forwards each request through: a model
of this server (``ar_encoder``, say) that stands in for the same model on another server, so
that ``omni``'s BLS calls and the ensembles' steps reach it by its usual name and nothing
else changes. The address may name several replicas (``dns:///encoder-pool:8001``, a
Kubernetes headless Service): gRPC then balances each call over them (round robin), and a call
that finds one unreachable is retried, a bounded number of times, on the next.

Errors keep their status: the remote stage's own (its message's ``[STATUS]`` tag, as every
stage of this project writes it) pass through as they are; an unreachable server, after the
retries, is ``UNAVAILABLE`` naming the stage and its address. Nothing here imports Triton's
Python backend: the adapter turns these arrays into its tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from triton_omni_protocol import STATUS_NAMES, parse_status

from triton_omni.errors import RemoteError

logger = logging.getLogger(__name__)

# gRPC codes of a server that is not there (down, restarting, or its address not resolving):
# the call never reached a model, so it is safe to send again
_UNREACHABLE = ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
CANCEL_POLL_S = 0.1  # how often a running call looks at its request's cancellation
# what a server that is stopping (a pod scaled in) answers once it has begun unloading its models
_DRAINING = "has no available versions"
DRAINING_REFUSALS = 20  # such answers sent elsewhere at once, before they count as unreachable attempts
DRAINING_PAUSE_S = 0.05


@dataclass(frozen=True)
class RemoteConfig:
    url: str  # host:port, or dns:///name:port for every address the name resolves to
    model: str  # the model's name on the remote server
    timeout_s: float = 600.0  # one call's deadline (a diffusion request may take minutes)
    retries: int = 2  # further attempts after an unreachable server
    backoff_s: float = 0.5  # before the first retry; doubled for each next

    def __post_init__(self):
        if not self.url.strip():
            raise ValueError("model parameter remote_url: the remote server's gRPC address (host:port) is required")
        if self.retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError(f"remote_retries must be >= 0, remote_timeout_s > 0 and remote_backoff_s >= 0, got "
                             f"{self.retries}, {self.timeout_s}, {self.backoff_s}")


class RemoteStage:
    def __init__(self, config: RemoteConfig, stage: str):
        import tritonclient.grpc as grpcclient

        self.config = config
        self.stage = stage  # this server's name for it, in error messages
        self._grpc = grpcclient
        # round robin over every address the name resolves to; reconnect soon after a restart
        self.client = grpcclient.InferenceServerClient(
            config.url, channel_args=[("grpc.lb_policy_name", "round_robin"),
                                      ("grpc.initial_reconnect_backoff_ms", 200),
                                      ("grpc.max_reconnect_backoff_ms", 2000)])
        self.counters = {"calls": 0, "retries": 0, "unreachable": 0, "cancelled": 0}

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str],
              cancelled: Callable[[], bool] | None = None) -> dict[str, np.ndarray]:
        """The remote model's answer to ``inputs``: ``outputs`` that it produced, by name. Once
        ``cancelled()`` says so, the remote call is cancelled too (the stage there drops the
        request, a diffusion at its next step) and this raises ``CANCELLED``."""
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        tensors = []
        for name, array in inputs.items():
            tensor = self._grpc.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        wanted = [self._grpc.InferRequestedOutput(name) for name in outputs]
        self.counters["calls"] += 1
        delay, attempt, refusals = self.config.backoff_s, 0, 0
        while True:
            try:
                result = self._call(tensors, wanted, cancelled)
            except InferenceServerException as error:
                draining = _DRAINING in (error.message() or "")
                if str(error.status()) not in _UNREACHABLE and not draining:
                    raise self._remote_error(error) from None
                if draining and refusals < DRAINING_REFUSALS:
                    # A replica that is unloading answers at once, and round robin sends the next call to
                    # another; the calls of other requests move it too, so one request can meet the
                    # leaving replica several times running (seen with 3 clients over 2 replicas)
                    refusals += 1
                    self.counters["retries"] += 1
                    time.sleep(DRAINING_PAUSE_S)
                    continue
                if attempt == self.config.retries:
                    self.counters["unreachable"] += 1
                    raise RemoteError("UNAVAILABLE", f"remote stage {self.stage} (its server at {self.config.url}) "
                                      f"unreachable after {attempt + 1} attempts ({error.message()[:200]}): "
                                      "retry shortly") from None
                self.counters["retries"] += 1
                logger.warning("stage %s at %s unreachable (%s); retrying in %.1f s", self.stage, self.config.url,
                               error.status(), delay)
                time.sleep(delay)
                delay *= 2
                attempt += 1
            else:
                return {name: array for name in outputs if (array := result.as_numpy(name)) is not None}

    def _call(self, tensors: list, wanted: list, cancelled: Callable[[], bool] | None):
        """One call, watched for ``cancelled`` while it runs."""
        done, answer = threading.Event(), {}

        def callback(result, error) -> None:
            answer.update(result=result, error=error)
            done.set()

        call = self.client.async_infer(self.config.model, tensors, callback, outputs=wanted,
                                       client_timeout=self.config.timeout_s)
        while not done.wait(CANCEL_POLL_S):
            if cancelled is not None and cancelled():
                call.cancel()
                self.counters["cancelled"] += 1
                raise RemoteError("CANCELLED", "request cancelled")
        if answer["error"] is not None:
            raise answer["error"]
        return answer["result"]

    @staticmethod
    def _remote_error(error) -> RemoteError:
        """The remote stage's error as it sent it: its status (its tag, else gRPC's code), its message."""
        status, message = parse_status(error.message() or "")
        if status is None:
            code = str(error.status() or "").removeprefix("StatusCode.")
            status = {"INVALID_ARGUMENT": "INVALID_ARG"}.get(code, code)
        return RemoteError(status if status in STATUS_NAMES else "INTERNAL", message)

    def close(self) -> None:
        self.client.close()
