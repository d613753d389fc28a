"""Locust load test for triton-omni: an HTTP user and a gRPC user.

Both users run the same three tasks, weighted:
- `ar`: text generation;
- `text_to_image`: the ensemble;
- `omni`: the BLS scheduler, alternating image-only and text+image requests.

HTTP speaks KServe v2 JSON through `FastHttpUser`. `text_to_image` goes to
`/infer`; `ar` and `omni` are decoupled and go to Triton's `/generate`,
since 2.51's `/infer` refuses decoupled models. gRPC goes through
`tritonclient.grpc`, made cooperative with gevent (`init_gevent`), and
reports each call through `events.request.fire`.

Settings come from environment variables (defaults in brackets):
  OMNI_GRPC_URL      gRPC address [localhost:8001]; the HTTP host is --host
  OMNI_WEIGHTS       ar,text_to_image,omni task weights [3,1,2]
  OMNI_PROMPTS       a file with one prompt per line [built-in prompts]
  OMNI_STEPS         diffusion steps per image [4]
  OMNI_MAX_TOKENS    tokens per text request [16]
  OMNI_TIMEOUT_S     a request's deadline, in seconds [none]
  OMNI_RAMP          phases of USERS@SECONDS, e.g. 2@20,60@40,2@40: the users held at each
                     count for that long, then the run ends (a load shape; --users and
                     --run-time are then ignored) [none: a flat load]

    make loadtest                        # starts the embedded server, CSVs in .cache/loadtest/
    .venv/bin/locust -f loadtest/locustfile.py --host http://localhost:8000   # web UI
"""

from __future__ import annotations

import atexit
import os
import random
import sys
import time
from pathlib import Path

from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any gRPC channel exists

import tritonclient.grpc as grpcclient  # noqa: E402
from locust import FastHttpUser, LoadTestShape, User, between, events, task  # noqa: E402
from triton_omni_client.client import batched_inputs, omni_inputs, stream_infer  # noqa: E402

GRPC_URL = os.environ.get("OMNI_GRPC_URL", "localhost:8001")
WEIGHTS = [int(w) for w in os.environ.get("OMNI_WEIGHTS", "3,1,2").split(",")]
STEPS = int(os.environ.get("OMNI_STEPS", "4"))
MAX_TOKENS = int(os.environ.get("OMNI_MAX_TOKENS", "16"))
TIMEOUT_S = float(os.environ["OMNI_TIMEOUT_S"]) if os.environ.get("OMNI_TIMEOUT_S") else None
PROMPTS = (Path(os.environ["OMNI_PROMPTS"]).read_text().split("\n") if os.environ.get("OMNI_PROMPTS") else [
    "a red fox in the snow", "a lighthouse at dusk", "a bowl of ramen, studio light",
    "a sailing boat on a calm sea", "an old library with tall windows", "a city street in the rain",
])
PROMPTS = [p for p in PROMPTS if p.strip()]


def ramp_phases(spec: str) -> list[tuple[int, float]]:
    """``"2@20,60@40"`` -> [(2, 20.0), (60, 40.0)]: users, seconds held."""
    phases = []
    for phase in spec.split(","):
        users, _, seconds = phase.partition("@")
        phases.append((int(users), float(seconds)))
    return phases


if os.environ.get("OMNI_RAMP"):
    class Ramp(LoadTestShape):
        """The users of OMNI_RAMP's phases in turn (all spawned at once), then the end of the run."""

        phases = ramp_phases(os.environ["OMNI_RAMP"])

        def tick(self):
            elapsed = self.get_run_time()
            for users, seconds in self.phases:
                if elapsed < seconds:
                    return users, max(users, 1)
                elapsed -= seconds
            return None


@events.quit.add_listener
def _skip_finalisation(exit_code: int, **kwargs) -> None:
    """Exit without interpreter finalisation: a gRPC channel closed from a
    ``__del__`` during shutdown can deadlock under gevent (seen here). The
    hook runs at exit, after Locust has closed its CSV files."""
    def exit_now() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)

    atexit.register(exit_now)


def omni_request(i: int) -> dict:
    """Image-only and text+image requests, alternating."""
    modalities = ["image"] if i % 2 == 0 else ["text", "image"]
    return {"text_input": random.choice(PROMPTS), "modalities": modalities, "max_tokens": MAX_TOKENS,
            "num_inference_steps": STEPS, "seed": i}


class HttpOmniUser(FastHttpUser):
    wait_time = between(0.05, 0.2)
    network_timeout = TIMEOUT_S or 60.0

    @task(WEIGHTS[0])
    def ar(self):
        body = {"text_input": random.choice(PROMPTS), "max_tokens": MAX_TOKENS}
        with self.client.post("/v2/models/ar/generate", json=body, name="http ar", catch_response=True) as r:
            _expect(r, "text_output")

    @task(WEIGHTS[1])
    def text_to_image(self):
        def tensor(name, datatype, value):
            return {"name": name, "shape": [1, 1], "datatype": datatype, "data": [value]}

        body = {"inputs": [tensor("text_input", "BYTES", random.choice(PROMPTS)),
                           tensor("num_inference_steps", "INT32", STEPS)],
                "outputs": [{"name": "image"}]}
        with self.client.post("/v2/models/text_to_image/infer", json=body, name="http text_to_image",
                              catch_response=True) as r:
            _expect(r, "outputs")

    @task(WEIGHTS[2])
    def omni(self):
        body = omni_request(random.randrange(1 << 30))
        with self.client.post("/v2/models/omni/generate", json=body, name="http omni", catch_response=True) as r:
            _expect(r, "image")


def _expect(response, key: str) -> None:
    if response.status_code != 200:  # 0: no response at all (a timeout, a refused connection): no text
        response.failure(f"HTTP {response.status_code}: {(response.text or repr(response.error))[:200]}")
    elif key not in response.json():
        response.failure(f"no {key!r} in the response")


class GrpcOmniUser(User):
    wait_time = between(0.05, 0.2)

    def on_start(self):
        self.client = grpcclient.InferenceServerClient(GRPC_URL)

    def on_stop(self):
        self.client.close()

    def _timed(self, name: str, call) -> None:
        start = time.perf_counter()
        length, error = 0, None
        try:
            length = call()
        except Exception as exc:  # reported to Locust as a failure, not raised
            # with its message: Locust records repr(), which is empty for tritonclient's exceptions
            error = RuntimeError(f"{type(exc).__name__}: {exc}")
        events.request.fire(request_type="grpc", name=name, response_time=(time.perf_counter() - start) * 1e3,
                            response_length=length, exception=error, context={})

    @task(WEIGHTS[0])
    def ar(self):
        values = {"text_input": random.choice(PROMPTS), "max_tokens": MAX_TOKENS}

        def call():
            results = list(stream_infer(GRPC_URL, "ar", omni_inputs(grpcclient, values), timeout_s=TIMEOUT_S))
            return sum(len(r.as_numpy("text_output")[0]) for r in results)

        self._timed("grpc ar", call)

    @task(WEIGHTS[1])
    def text_to_image(self):
        def call():
            inputs = batched_inputs(grpcclient, text_input=random.choice(PROMPTS), num_inference_steps=STEPS)
            return self.client.infer("text_to_image", inputs, client_timeout=TIMEOUT_S).as_numpy("image").nbytes

        self._timed("grpc text_to_image", call)

    @task(WEIGHTS[2])
    def omni(self):
        values = omni_request(random.randrange(1 << 30)) | {"stream": True}

        def call():
            results = list(stream_infer(GRPC_URL, "omni", omni_inputs(grpcclient, values), timeout_s=TIMEOUT_S))
            images = [r.as_numpy("image") for r in results if r.as_numpy("image") is not None]
            if not images:
                raise RuntimeError("omni returned no image")
            return sum(i.nbytes for i in images)

        self._timed("grpc omni", call)
