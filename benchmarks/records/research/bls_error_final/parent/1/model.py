"""Calls ``child`` through BLS (decoupled) and prints what of its stream arrives."""

import threading

import triton_python_backend_utils as pb_utils

FLAG = "/tmp/bls-error-final.flag"  # the parent tells the child to stop
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.serve, args=(request, request.get_response_sender()), daemon=True).start()

    def serve(self, request, sender):
        mode = pb_utils.get_input_tensor_by_name(request, "MODE")
        child = pb_utils.InferenceRequest(model_name="child", inputs=[mode], requested_output_names=["N"])
        responses = child.exec(decoupled=True)
        got = 0
        if int(mode.as_numpy()[0]) in (3, 4):  # read the whole stream, nobody cancels
            for response in responses:
                got += 1
                message = response.error().message() if response.has_error() else None
                print(f"EXP parent got {got} outputs={len(response.output_tensors())} error={message}", flush=True)
            print(f"EXP parent done after {got}", flush=True)
            sender.send(flags=FINAL)
            return
        for response in responses:
            if sender.is_cancelled():  # the client left: tell the child, then read the rest
                open(FLAG, "w").close()
                print("EXP parent cancelled", flush=True)
                break
            numbers = pb_utils.get_output_tensor_by_name(response, "N").as_numpy()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("N", numbers)]))
        sender.send(flags=FINAL)
        for response in responses:
            got += 1
            if response.has_error():
                print(f"EXP parent drain got error: {response.error().message()}", flush=True)
        print(f"EXP parent drain done after {got}", flush=True)
