"""Python-based Triton backend ``omni_remote``: a stage served by another Triton server.

The model keeps the stage's name, tensors and batching (its config is the stage's own, with
``backend: "omni_remote"`` and the remote's address: ``omni-triton serve --remote
ar_encoder=HOST:PORT`` writes it), so ``omni``'s BLS calls and the ensembles reach the stage
as they would inside one server. Each request is forwarded as it came, on a thread of its
own (``execute`` returns at once, as ``ar_encoder``'s does with vLLM, so the requests of one
batch and of the next are in flight together), and its answer or its typed error goes back
through the response thread.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_omni.triton  # noqa: F401 - first: fixes the stub's locale
import triton_python_backend_utils as pb_utils
from triton_omni.channel import Cancellations
from triton_omni.remote import RemoteConfig, RemoteStage
from triton_omni.triton import ar_io, diffusion_io
from triton_omni.triton.errors import triton_error
from triton_omni.triton.params import channel_ids, model_parameters
from triton_omni.triton.responses import ResponseThread

logger = logging.getLogger("omni_remote")

# the stages that may be remote, by the backend that serves them locally: whose tensors this model declares
STAGE_IO = {"omni_ar": ar_io, "omni_diffusion": diffusion_io}


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        params = model_parameters(auto_complete_model_config.as_dict())
        return STAGE_IO[params.get("remote_backend", "")].auto_complete(auto_complete_model_config)

    def initialize(self, args):
        self.model_name = args["model_name"]
        model_config = json.loads(args["model_config"])
        params = model_parameters(model_config)
        config = RemoteConfig(url=params.get("remote_url", ""), model=params.get("remote_model") or self.model_name,
                              timeout_s=float(params.get("remote_timeout_s", RemoteConfig.timeout_s)),
                              retries=int(params.get("remote_retries", RemoteConfig.retries)))
        self.outputs = [output["name"] for output in model_config.get("output", [])]
        self.remote = RemoteStage(config, self.model_name)
        self.responses = ResponseThread()
        self.cancellations = Cancellations()  # omni's flags for the requests it sent
        self.pool = ThreadPoolExecutor(max_workers=int(params.get("remote_max_in_flight", "64")),
                                       thread_name_prefix="omni-remote")
        logger.info("model %s: forwarded to model %s at %s", self.model_name, config.model, config.url)

    def execute(self, requests):
        for request in requests:
            # read now: the request's tensors are released when execute returns
            inputs = {tensor.name(): np.array(tensor.as_numpy()) for tensor in request.inputs()}
            outputs = list(request.requested_output_names()) or self.outputs
            key, _ = channel_ids(request)
            sender, cancelled = request.get_response_sender(), threading.Event()
            # the client's cancellation, or omni's for a request it sent, cancels the remote call
            self.responses.watch(sender, cancelled.set, lambda key=key: self.cancellations.is_cancelled(key))
            self.pool.submit(self._forward, sender, inputs, outputs, cancelled)
        return None

    def _forward(self, sender, inputs, outputs, cancelled: threading.Event) -> None:
        try:
            answer = self.remote.infer(inputs, outputs, cancelled.is_set)
            response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in answer.items()])
        except Exception as error:  # a request fails alone, and says why (a RemoteError with the remote's status)
            response = pb_utils.InferenceResponse(error=triton_error(error, f"model '{self.model_name}'"))
        self.responses.unwatch(sender)
        self.responses.send(sender, response, final=True)

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.remote.close()
        self.responses.stop()
