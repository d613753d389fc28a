"""LoRA adapters per request (``lora.py``), on each DiT family's tiny demo and the CPU: requests with
different adapters and scales share one step batch, and each image equals the family's pipeline with
``load_lora_weights(...)`` and ``set_adapters([name], [scale])`` for that request alone; a request
without one equals the same batch on a model with no adapters, bit for bit. An adapter moves the
tiny demo's image by tens of levels and its scale by several (so the tolerance of one level can
fail); with ``lora_fuse`` a batch sharing one adapter runs it fused. The step cache's smaller
batches keep each row's adapter; ``compile: blocks`` compiles once for any mix of adapters. Bad
adapters fail the model's load naming the adapter and the layer; bad requests are refused naming
their field. Adapters beyond ``max_loras`` take the least recently used free slot."""

from __future__ import annotations

import pytest
import torch
from triton_omni.diffusion import DiffusionRunner, DiffusionRunnerConfig
from triton_omni.diffusion import runner as runner_module
from triton_omni.errors import RequestValidationError
from triton_omni.lora import AdapterError, parse_sources

from tests.support.loras import build_expert_pair, build_lora, with_adapter
from tests.support.pipelines import DEMO_PIPELINES, GUIDANCE_KEYWORD, call, levels_apart

FAMILIES = ("qwen-image", "z-image", "flux2-klein", "flux1-dev", "wan")
# a video family's frame count: the model's default, and the pipeline's call
VIDEO = {"wan": {"num_frames": 5}, "wan2.2-a14b": {"num_frames": 5}}
OPTIONS = {"num_inference_steps": 3, "height": 32, "width": 32, "guidance_scale": 4.0}
PROMPT, NEGATIVE = "a red fox", "blurry"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Per family: ``a`` (rank 4), ``b`` (rank 8, alpha 8: scaling 1), ``c`` (rank 2, attention only)."""
    root = tmp_path_factory.mktemp("loras")
    return {family: {"a": str(build_lora(family, root / family / "a", seed=1, rank=4)),
                     "b": str(build_lora(family, root / family / "b", seed=2, rank=8, alpha=8)),
                     "c": str(build_lora(family, root / family / "c", seed=3, rank=2,
                                         targets=["to_q", "to_v"]))}
            for family in FAMILIES}


def runner(family: str, sources: dict[str, str] | None, **config) -> DiffusionRunner:
    return DiffusionRunner(DiffusionRunnerConfig(DEMO_PIPELINES[family], batching=config.pop("batching", "step"),
                                                 exact_batching=False, lora_adapters=sources or {},
                                                 defaults=VIDEO.get(family, {}), **config))


def request(seed: int, lora: str | None = None, scale: float | None = None, **more) -> dict:
    values = {"prompt": PROMPT, "negative_prompt": NEGATIVE, "seed": seed, **OPTIONS, **more}
    return values | ({"lora": lora} if lora else {}) | ({"lora_scale": scale} if scale is not None else {})


def images(model: DiffusionRunner, requests: list[dict], together: bool = False) -> list:
    """All of ``requests`` submitted at once: they share the engine's steps. ``together``: and
    checks that they shared every step (their adapters were already loaded)."""
    reported: list[int] = []
    results = model.run([model.parse(r) for r in requests], on_step=lambda i, step, total: reported.append(step))
    if together:  # every request's first step came before any second
        assert reported[:len(requests)] == [1] * len(requests), reported
    for result in results:
        if isinstance(result, Exception):
            raise result
    return [image.numpy() for image in results]


def reference(family: str, folder: str | None, scale: float, seed: int, negative: str | None = NEGATIVE):
    with with_adapter(family, folder, scale) as pipe:
        return call(pipe, PROMPT, negative, guidance_keyword=GUIDANCE_KEYWORD[family], seed=seed,
                    guidance_scale=OPTIONS["guidance_scale"], num_inference_steps=OPTIONS["num_inference_steps"],
                    height=OPTIONS["height"], width=OPTIONS["width"], **VIDEO.get(family, {}))[0].numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_adapters_in_one_step_batch_equal_the_pipeline_with_each(family, adapters):
    sources = adapters[family]
    mix = [("a", 0.8), (None, None), ("b", None), ("a", 1.5), ("c", -1.0)]
    model = runner(family, sources, max_loras=3)
    try:
        images(model, [request(1, name, num_inference_steps=1) for name in sources])  # all loaded: one batch next
        served = images(model, [request(7, lora, scale) for lora, scale in mix], together=True)
        alone = images(model, [request(7, "a", 0.8)])[0]
    finally:
        model.close()
    expected = [reference(family, sources.get(lora), 1.0 if scale is None else scale, 7) for lora, scale in mix]
    for (lora, scale), image, pipe_image in zip(mix, served, expected, strict=True):
        assert levels_apart(image, pipe_image) <= 1, (lora, scale)
    assert levels_apart(alone, expected[0]) <= 1
    base = expected[1]
    assert min(levels_apart(e, base) for e in expected[:1] + expected[2:]) > 10  # an adapter moves the image
    assert levels_apart(expected[0], expected[3]) > 5  # and so does its scale
    plain = runner(family, None)
    try:  # the request without an adapter, in the same company on a model with none: bit for bit
        unadapted = images(plain, [request(7) for _ in mix], together=True)
    finally:
        plain.close()
    assert (served[1] == unadapted[1]).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_adapted_request_without_a_negative_or_with_an_empty_or_blank_one_equals_the_pipeline(family, adapters):
    """The negative prompt as users leave it: omitted (each pipeline's own default: "" for CFG,
    no negative pass for true CFG), "" and " ", in one step batch, each against the pipeline with
    the adapter called the same way; the adapted image differs from the unadapted one (so each
    comparison can fail)."""
    sources = adapters[family]
    negatives = [None, "", " "]
    model = runner(family, sources)
    try:
        served = images(model, [{key: value for key, value in request(5, "a", 0.8, negative_prompt=negative).items()
                                 if value is not None} for negative in negatives])
    finally:
        model.close()
    for negative, image in zip(negatives, served, strict=True):
        expected = reference(family, sources["a"], 0.8, 5, negative)
        assert levels_apart(image, expected) <= 1, repr(negative)
    assert levels_apart(served[0], reference(family, None, 1.0, 5, None)) > 10


def test_the_step_cache_keeps_each_rows_adapter_in_its_smaller_batches(adapters):
    """One request reuses its cached blocks while its neighbours compute them: the computing rows
    run the remaining blocks alone, with their own adapters."""
    sources = adapters["qwen-image"]
    company = [request(7, "a", step_cache="first_block:1.0"), request(8, "b"), request(9),
               request(10, "c", step_cache="first_block:1.0", num_inference_steps=4)]
    model = runner("qwen-image", sources, max_loras=3)
    try:
        together = images(model, company)
        apart = [images(model, [r])[0] for r in company]
    finally:
        model.close()
    for joint, solo in zip(together, apart, strict=True):
        assert levels_apart(joint, solo) <= 1


def test_a_two_expert_models_adapters_come_as_pairs_and_each_expert_runs_its_half(tmp_path):
    """Wan 2.2 T2V-A14B: an adapter is a file per expert (``transformer``, ``transformer_2``), or
    one file for the first expert alone (as ``load_lora_weights(path)`` loads it); requests with
    pairs, a one-expert adapter, scales and none share one step batch, each equal to the pipeline
    with the same adapters loaded (the second with ``load_into_transformer_2=True``). The steps
    span both experts, and each half moves the video: the pair against its first half alone."""
    family = "wan2.2-a14b"
    pair = build_expert_pair(family, tmp_path / "pair", seed=11)
    sources = {"pair": pair, "high": pair["transformer"]}
    mix = [("pair", 0.8), (None, None), ("high", None), ("pair", 1.5)]
    more = VIDEO[family] | {"num_inference_steps": 4}
    model = runner(family, sources)
    try:
        images(model, [request(1, name, num_inference_steps=1) for name in sources])  # loaded: one batch next
        served = images(model, [request(7, lora, scale, **more) for lora, scale in mix], together=True)
        schedule = model.steps.adapter.experts, model.steps.adapter.boundary
    finally:
        model.close()
    assert len(schedule[0]) == 2 and schedule[1] is not None
    expected = []
    for lora, scale in mix:
        with with_adapter(family, sources.get(lora), 1.0 if scale is None else scale) as pipe:
            expected.append(call(pipe, PROMPT, NEGATIVE, seed=7, guidance_scale=OPTIONS["guidance_scale"],
                                 height=OPTIONS["height"], width=OPTIONS["width"], **more)[0].numpy())
    for (lora, scale), video, pipe_video in zip(mix, served, expected, strict=True):
        assert levels_apart(video, pipe_video) <= 1, (lora, scale)
    assert levels_apart(expected[0], expected[1]) > 10  # the adapter moves the video
    with with_adapter(family, {"transformer": pair["transformer"]}, 0.8) as pipe:  # its first half alone
        first_half = call(pipe, PROMPT, NEGATIVE, seed=7, guidance_scale=OPTIONS["guidance_scale"],
                          height=OPTIONS["height"], width=OPTIONS["width"], **more)[0].numpy()
    assert levels_apart(expected[0], first_half) > 10  # the second expert's half is read too
    with pytest.raises(AdapterError, match="names 'transformer_3': this pipeline's denoisers are transformer, "
                                           "transformer_2"):
        runner(family, {"odd": {"transformer_3": pair["transformer"]}})
    with pytest.raises(AdapterError, match="'pair' names a file per denoiser, and this model has one"):
        runner("wan", {"pair": pair})


@pytest.mark.parametrize("family", ["qwen-image", "wan"])
def test_a_shared_adapter_runs_fused_and_every_image_stays_the_pipelines(family, adapters):
    """``lora_fuse``: a step batch whose requests all run one adapter at one scale runs it fused into
    copies of the weights (a new pair refuses the stale copy, and so does another adapter loaded
    into its slot); a mixed batch runs the factors; a request without an adapter stays the base
    model's bit for bit after all of it. One slot: ``b`` evicts ``a``, which comes back."""
    sources = {"a": adapters[family]["a"], "b": adapters[family]["b"]}
    plan = [[("a", 0.8)] * 3, [("a", 1.5)] * 2, [("b", None)] * 2, [("a", None)] * 2,
            [("a", 0.8), (None, None), ("a", 0.8)]]
    model = runner(family, sources, max_loras=1, lora_fuse=True)
    try:
        served, fused = [], []
        for batch in plan:
            served.append(images(model, [request(7, lora, scale) for lora, scale in batch]))
            fused.append(model.adapters._fused)
    finally:
        model.close()
    assert fused[:4] == [(0, 0.8), (0, 1.5), (0, 1.0), (0, 1.0)]  # one slot: the last, a's after b's
    for batch, images_ in zip(plan, served, strict=True):
        for (lora, scale), image in zip(batch, images_, strict=True):
            expected = reference(family, sources.get(lora), 1.0 if scale is None else scale, 7)
            assert levels_apart(image, expected) <= 1, (lora, scale)
    assert levels_apart(served[0][0], served[1][0]) > 5  # the scale reached the fused weights
    plain = runner(family, None)
    try:
        unadapted = images(plain, [request(7) for _ in plan[-1]])
    finally:
        plain.close()
    assert (served[-1][1] == unadapted[1]).all()


def test_request_batching_runs_a_group_with_its_adapter(adapters):
    sources = adapters["z-image"]
    model = runner("z-image", sources, batching="request", max_loras=1)
    try:
        served = images(model, [request(7, "b", 0.5), request(8), request(9, "b", 0.5)])
    finally:
        model.close()
    assert levels_apart(served[0], reference("z-image", sources["b"], 0.5, 7)) <= 1
    assert levels_apart(served[1], reference("z-image", None, 1.0, 8)) <= 1
    assert levels_apart(served[2], reference("z-image", sources["b"], 0.5, 9)) <= 1


def test_adapters_beyond_the_slots_evict_the_least_recently_used_free_one(adapters):
    events = []
    model = DiffusionRunner(DiffusionRunnerConfig(DEMO_PIPELINES["qwen-image"], batching="step",
                                                  lora_adapters=adapters["qwen-image"], max_loras=2),
                            on_lora=lambda event, name: events.append((event, name)))
    try:
        for name in ("a", "b", "a", "c", "b"):  # c evicts b (a was used since); b then evicts a
            images(model, [request(7, name, num_inference_steps=1)])
        # more adapters at once than slots: the third waits for a slot its predecessors free
        images(model, [request(7, name, num_inference_steps=2) for name in ("a", "b", "c")])
        assert len(model.adapters.resident()) == 2
    finally:
        slots = model.adapters.slots
        model.close()
    loads = [name for event, name in events if event == "load"]
    evictions = [name for event, name in events if event == "eviction"]
    assert loads[:4] == ["a", "b", "c", "b"] and evictions[:2] == ["b", "a"]
    assert [name for event, name in events if event == "request"] == ["a", "b", "a", "c", "b", "a", "b", "c"]
    assert all(slot.pins == 0 for slot in slots)


def test_bad_requests_are_refused_naming_their_field(adapters):
    model = runner("qwen-image", adapters["qwen-image"], max_loras=1)
    plain = runner("qwen-image", None)
    try:
        for model_, values, field, says in (
                (model, request(1, "nope"), "lora", "unknown adapter"),
                (model, request(1, scale=0.5), "lora_scale", "goes with lora"),
                (model, request(1, "a", 11.0), "lora_scale", "must be in"),
                (model, request(1, "a", float("nan")), "lora_scale", "finite"),
                (plain, request(1, "a"), "lora", "serves no LoRA adapters")):
            with pytest.raises(RequestValidationError) as refused:
                model_.parse(values)
            assert refused.value.parameter == field and says in str(refused.value)
        assert model.parse(request(1) | {"lora": ""}).lora is None  # empty: none, as an ensemble's unset input
    finally:
        model.close()
        plain.close()


def test_adapters_that_do_not_fit_fail_the_load_naming_the_adapter_and_the_layer(adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "wide"
    folder.mkdir()
    tensors = load_file(f"{adapters['qwen-image']['a']}/pytorch_lora_weights.safetensors")
    key = next(k for k in tensors if k.endswith("to_q.lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] * 2)
    save_file(tensors, folder / "pytorch_lora_weights.safetensors")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    whole = (folder / "pytorch_lora_weights.safetensors").read_bytes()
    (corrupt / "pytorch_lora_weights.safetensors").write_bytes(whole[: len(whole) // 2])
    layer = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
    for family, sources, says in (
            ("qwen-image", {"wide": str(folder)}, f"'wide' does not fit this model at {layer}"),
            ("qwen-image", {"corrupt": str(corrupt)}, "'corrupt'"),
            ("qwen-image", {"gone": str(tmp_path / "missing")}, "'gone'"),
            ("qwen-image", {"other": adapters["z-image"]["a"]}, "'other' does not fit this model"),
            ("z-image", {"flat": str(build_lora("z-image", tmp_path / "flat", 4, targets=["cap_embedder.1"]))},
             "cap_embedder.1")):
        with pytest.raises(AdapterError, match=says):
            runner(family, sources)


def test_configuration_is_checked_at_load(adapters):
    with pytest.raises(ValueError, match="the stable_diffusion family takes no LoRA"):
        runner("sd", {"a": adapters["qwen-image"]["a"]})
    with pytest.raises(ValueError, match="max_loras must be at least 1"):
        runner("qwen-image", adapters["qwen-image"], max_loras=0)
    with pytest.raises(ValueError, match="not with a parallel mode"):
        runner("qwen-image", adapters["qwen-image"], cfg_device="cpu")
    with pytest.raises(ValueError, match="lora_fuse: this model has no lora_adapters"):
        runner("qwen-image", None, lora_fuse=True)
    with pytest.raises(ValueError, match="lora_fuse needs exact_batching false"):
        DiffusionRunner(DiffusionRunnerConfig(DEMO_PIPELINES["qwen-image"], lora_adapters=adapters["qwen-image"],
                                              lora_fuse=True))
    assert parse_sources('{"a": "x/y"}') == {"a": "x/y"}
    pair = '{"a": {"transformer": "h", "transformer_2": "l"}}'
    assert parse_sources(pair) == {"a": {"transformer": "h", "transformer_2": "l"}}
    for text in ("[1]", '{"a": 3}', "{", '{"": "x"}', '{"a": {}}', '{"a": {"transformer": 1}}', '{"a": {"": "x"}}'):
        with pytest.raises(ValueError, match="lora_adapters"):
            parse_sources(text)


@pytest.mark.parametrize("fuse", [False, True], ids=["factors", "fused"])
def test_compiled_blocks_compile_once_for_any_mix_of_adapters(adapters, monkeypatch, fuse):
    """Warmed up with no adapter, one for every row and a mix, the blocks take new mixes, another
    scale and a newly loaded adapter without compiling again, and give the eager images; fused or
    not, the shared adapter's passes included."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    monkeypatch.setattr(runner_module, "COMPILE_OPTIONS", {"dynamic": True})
    sources = adapters["qwen-image"]
    warm_up = [[request(7)], [request(7, "a")], [request(7, "a"), request(8), request(9, "b", 0.5)]]
    later = [[request(7, "b")], [request(7, "b", 1.2), request(8, "a")],
             [request(7, "c", 0.7), request(8, "a"), request(9), request(10, "b")]]
    compiled = runner("qwen-image", sources, max_loras=3, compile="blocks", lora_fuse=fuse)
    try:
        for batch in warm_up:
            images(compiled, batch)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0
        served = [images(compiled, batch) for batch in later]
        assert counters["stats"]["unique_graphs"] == graphs  # no recompile for another mix, scale or adapter
        if fuse:  # three rows padded to a bucket of four still share one adapter: fused
            images(compiled, [request(7, "a", 0.5), request(8, "a", 0.5), request(9, "a", 0.5)])
            assert compiled.adapters._fused is not None and compiled.adapters._fused[1] == 0.5
    finally:
        compiled.close()
    eager = runner("qwen-image", sources, max_loras=3)
    try:
        for batch, compiled_images in zip(later, served, strict=True):
            for e, c in zip(images(eager, batch), compiled_images, strict=True):
                assert levels_apart(e, c) <= 1
    finally:
        eager.close()
