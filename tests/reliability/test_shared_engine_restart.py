"""Two `ar` instances in front of one vLLM engine core (`instances_per_engine: 2`)
on a supervised server: the stub that started the engine is killed under load.
Readiness says so, the supervisor reloads the model, the new first instance
ends the engine core the dead stub left behind and starts its own, and the
model serves again, every request meanwhile answered (docs/gpu.md, "Several
instances in front of one engine")."""

from __future__ import annotations

import time

import pytest
import tritonclient.grpc as grpcclient
from triton_omni.demo_models import build_all
from triton_omni_client.client import omni_inputs, stream_infer
from triton_omni_tools.launcher import DEFAULT_REPOSITORIES, ServerOptions, TritonServer, free_port
from triton_omni_tools.repository import copy_model
from triton_omni_tools.supervisor import server_stubs

from tests.reliability.test_stub_restart import DEADLINE_S, Load, kill_and_watch
from tests.support.server import children, engine_cores, model_ready, xfail_if_triton_aborted_on_a_dead_stub

MODEL = "ar_shared"


def generate(url: str) -> None:
    values = {"text_input": "a red fox", "max_tokens": 4}
    assert list(stream_infer(url, MODEL, omni_inputs(grpcclient, values), timeout_s=DEADLINE_S))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    build_all()
    variants = tmp_path_factory.mktemp("shared")
    copy_model(DEFAULT_REPOSITORIES[0], "ar", variants, MODEL, parameters={"instances_per_engine": "2"},
               instance_group=[{"kind": "KIND_CPU", "count": 2}])
    options = ServerOptions(model_repositories=[variants], http_port=free_port(), grpc_port=free_port(),
                            metrics_port=free_port(), log_file=tmp_path_factory.mktemp("logs") / "tritonserver.log",
                            supervise=True, admin_key="reliability", model_control_mode="explicit",
                            load_models=[MODEL])
    with TritonServer(options) as triton:
        yield triton


def test_the_engines_first_instance_killed_under_load_and_the_model_serves_again(server):
    url = server.grpc_url
    generate(url)
    [engine] = engine_cores(server)
    [first] = [s for s in server_stubs(server.process.pid) if s.model == MODEL and engine in children(s.pid)]
    with Load(generate, url) as load:
        time.sleep(1)
        noticed, back = kill_and_watch(server, MODEL, first.pid, timeout_s=240)
    xfail_if_triton_aborted_on_a_dead_stub(server)
    assert server.process.poll() is None, f"tritonserver exited ({server.process.returncode}) after the stub's kill"
    print(f"{MODEL}: not ready after {noticed:.1f} s, serving again after {back:.1f} s; {load.sent} sent, "
          f"{load.succeeded} succeeded, errors: {sorted(set(e[:90] for e in load.errors))}")
    assert noticed <= 5 and model_ready(server, MODEL), f"not ready after {noticed:.1f} s, back after {back:.1f} s"
    generate(url)
    assert load.sent == load.succeeded + len(load.errors)  # every request answered, none hanging
    engines = engine_cores(server)
    assert len(engines) == 1 and engine not in engines, f"engine cores now {engines}, the old one was {engine}"
