"""Streams a number every 5 ms until the parent's flag (or 10, in modes 3 and 4), then ends as its mode says."""

import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FLAG = "/tmp/bls-error-final.flag"  # the parent tells the child to stop
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0])
            threading.Thread(target=self.serve, args=(request.get_response_sender(), mode), daemon=True).start()

    def serve(self, sender, mode):
        n = 0
        while not os.path.exists(FLAG) and not (mode in (3, 4) and n == 10):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("N", np.array([n], np.int32))]))
            n += 1
            time.sleep(0.005)
        cancelled = pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)
        if mode == 4:  # the error as a response of its own, then the final flag alone
            sender.send(pb_utils.InferenceResponse(error=cancelled))
            sender.send(flags=FINAL)
        elif mode in (0, 3):  # an error final, as the stages ended a cancelled request
            sender.send(pb_utils.InferenceResponse(error=cancelled), flags=FINAL)
        elif mode == 1:  # a final flag alone
            sender.send(flags=FINAL)
        else:  # an error final that is not CANCELLED
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("stopped")), flags=FINAL)
        print(f"EXP child sent final mode={mode} after {n}", flush=True)
